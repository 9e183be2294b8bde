"""``python -m tensorshare_server``: the same as the ``tensorshare-server`` command."""

import sys

from .cli import main

sys.exit(main())
