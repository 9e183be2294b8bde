"""``python -m tensorshare_server.workers``: one worker of a multi-worker server (started by its parent)."""

import sys

from .child import main

sys.exit(main())
