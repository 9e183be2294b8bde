"""The command line of the original tensorshare's examples: ``--help``, ``--port`` for
the port their text names (8000, the default), and ``--pauses`` to scale the pauses
their text makes (the worker's 0.2 s between rollouts, the trainer's 0.5 s between
reads; 1, the default, keeps them as written)."""

import argparse
import sys
import time


def port(doc: str) -> int:
    """The ``--port`` given (8000 if none), after ``--help`` if asked; with ``--pauses F``
    the script's own ``sleep`` calls sleep F times as long."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                     epilog="The original's code, unchanged but for the port it names.")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (default: 8000, the original's)")
    parser.add_argument("--pauses", type=float, default=1.0, metavar="F",
                        help="multiply the example's own pauses by F (default: 1, as written; the tests run "
                             "the examples with shorter ones)")
    args = parser.parse_args()
    if args.pauses < 0:
        parser.error("--pauses must be 0 or more")
    if args.pauses != 1.0:
        _scale_script_pauses(args.pauses)
    return args.port


def _scale_script_pauses(factor: float) -> None:
    """Make ``time.sleep`` (which the script imports after calling :func:`port`) sleep
    ``factor`` times as long when the script itself calls it; calls from anywhere
    else (the library's own waits and backoffs) sleep as asked."""
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":
            seconds *= factor
        real_sleep(seconds)

    time.sleep = sleep
