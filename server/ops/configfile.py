"""``tensorshare-server --config server.toml``: every command-line option, from a TOML file.

Keys are the long option names without the dashes (``memory-limit = "8GB"``;
``memory_limit`` works too); values are TOML strings, numbers or booleans, read as
the command line reads them (sizes like ``"512MiB"``).  A switch is a boolean
(``fsync = true``, ``no-zero-copy = true`` or ``zero-copy = false``).  Options given
on the command line win over the file.  An unknown key is an error, so a typo
never passes silently.
"""

from __future__ import annotations

import argparse


def read_toml(path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise argparse.ArgumentTypeError("reading a TOML config file on Python 3.10 needs tomli "
                                             "(pip install tomli)") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise argparse.ArgumentTypeError(f"config file {path} is not valid TOML: {exc}") from None


def defaults_from(parser: argparse.ArgumentParser, table: dict, path: str) -> dict:
    """Map a config file's ``table`` to ``{dest: value}`` for ``parser.set_defaults``."""
    by_name: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse has no public walk of its actions
        for option in action.option_strings:
            if option.startswith("--"):
                by_name[option[2:]] = action
    out = {}
    for key, value in table.items():
        name = str(key).replace("_", "-")
        action = by_name.get(name)
        negated = False
        if action is None and by_name.get("no-" + name) is not None:
            action, negated = by_name["no-" + name], True
        if action is None or action.dest in ("help", "config"):
            raise argparse.ArgumentTypeError(f"{path}: unknown option {key!r}")
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"{path}: {key} must be true or false")
            flag_on = value != negated  # the switch as written on the command line is on
            out[action.dest] = action.const if flag_on else action.default
            continue
        if isinstance(value, (dict, list)) or isinstance(value, bool):
            raise argparse.ArgumentTypeError(f"{path}: {key} must be a string or a number")
        if action.type is not None:
            try:  # read as the command line would read it (sizes, seconds), and said wrong here
                value = action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise argparse.ArgumentTypeError(f"{path}: {key} = {value!r}: {exc}") from None
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentTypeError(f"{path}: {key} = {value!r}: one of {', '.join(action.choices)}")
        out[action.dest] = value
    return out
