"""``python -m tensorshare_server``: the same as the ``tensorshare-server`` command."""

import sys

from .app import main

sys.exit(main())
