"""Client processes that tests/test_faults.py kills in the middle of large transfers.

They speak raw frames and never import torch, so twenty of them start in moments::

    fault_procs.py put PORT BIN DESC_HEX NBYTES VALUE FRACTION  # send FRACTION of a PUT, say "mid", wait
    fault_procs.py putloop PORT BIN DESC_HEX NBYTES VALUE       # PUT the same value over and over
    fault_procs.py get PORT BIN READ_BYTES                      # GET, read READ_BYTES of the reply, wait

The PUT value is an int32 tensor of NBYTES / 4 elements all equal to VALUE, whose
description (made by the test) is DESC_HEX.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

from tensorshare.wire.frames import frame_head


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    return sock


def put_frame(rid: int, name: str, description: bytes, nbytes: int, value: int) -> tuple[bytes, bytes]:
    head = frame_head({"op": "PUT", "id": rid, "bin": name, "value": description}, nbytes)
    return head, struct.pack("<i", value) * (nbytes // 4)


def main(argv: list[str]) -> None:
    mode, port, name = argv[0], int(argv[1]), argv[2]
    if mode in ("put", "putloop"):
        description, nbytes, value = bytes.fromhex(argv[3]), int(argv[4]), int(argv[5])
        sock = connect(port)
        if mode == "put":
            head, payload = put_frame(1, name, description, nbytes, value)
            sock.sendall(head + payload[: int(len(payload) * float(argv[6]))])
            print("mid", flush=True)
            time.sleep(120)
        rid = 1
        while True:
            head, payload = put_frame(rid, name, description, nbytes, value)
            sock.sendall(head)
            if rid == 1:
                print("mid", flush=True)
            sock.sendall(payload)
            rid += 1
    elif mode == "get":
        want = int(argv[3])
        sock = connect(port, rcvbuf=256 << 10)  # no autotuning: most of the reply stays on the server
        sock.sendall(frame_head({"op": "GET", "id": 1, "bin": name}, 0))
        got = 0
        while got < want:
            chunk = sock.recv(min(1 << 20, want - got))
            if not chunk:
                raise SystemExit("server closed the connection")
            got += len(chunk)
        print("mid", flush=True)
        time.sleep(120)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
