"""What an example needs beyond the core: a missing extra is named, with how to install it."""

import importlib
import sys


def need(extra: str, *modules: str) -> None:
    """Exit, saying what to install, unless every one of ``modules`` (of ``extra``) imports."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise SystemExit(f"{sys.argv[0]} needs {' and '.join(missing)}, of the {extra} extra: "
                         f"pip install 'torch-tensorshare[{extra}]' (in a clone: pip install -e '.[{extra}]')")
