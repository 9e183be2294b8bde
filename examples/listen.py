"""Listening: a callback runs on every change to a bin, with no polling.

    tensorshare-server --port 8000 &
    python examples/listen.py --port 8000
"""
import argparse
import threading

import torch

import tensorshare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    done = threading.Event()

    def on_change(note: tensorshare.Notification) -> None:
        print(f"bin {note.bin!r}: {note.op}, now {note.n_items} item(s) (seq {note.seq})")
        if note.op == "DELETE":
            done.set()

    with tensorshare.Client(args.host, args.port) as listener, tensorshare.Client(args.host, args.port) as writer:
        handle = listener.listen("events", on_change)
        print("listening; bin had", handle.snapshot.n_items, "item(s)")
        writer.append("events", torch.arange(3))
        writer.append("events", torch.arange(4))
        writer.get("events")
        writer.delete("events")
        if not done.wait(10):
            raise SystemExit("notifications did not arrive")
        handle.stop()


if __name__ == "__main__":
    main()
