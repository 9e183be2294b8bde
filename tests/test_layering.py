"""The layering holds: the server never loads torch or the client's internals, and
the protocol and wire-format modules both ends share load neither end."""

from __future__ import annotations

import subprocess
import sys

import pytest

SERVER_RUN = """
import sys
import msgpack
from tensorshare_server.config import ServerConfig
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import build_state
from tensorshare.wire.frames import FrameDecoder, discard_sink, frame_head

class Outbox:
    congested = False
    def __init__(self): self.data = bytearray()
    def send(self, parts, on_abandon=None, on_written=None):
        for p in parts: self.data += bytes(p)
    def withdraw(self, ticket): return False
    def close(self): pass

state = build_state(ServerConfig(zero_copy=False))
out = Outbox()
session = ServerSession(state, out, "layering")
session.connection_made()
blob = msgpack.packb({"v": None, "t": [], "n": 0})
session.data_received(frame_head({"op": "PUT", "id": 1, "bin": "b", "value": blob}, 0)
                      + frame_head({"op": "GET", "id": 2, "bin": "b"}, 0))
codes = [f.header["code"] for f in FrameDecoder(discard_sink).feed(bytes(out.data))]
assert codes == [220, 250, 226], codes
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "tensorshare._client",
                                                                       "tensorshare.client", "tensorshare.async_client")))
print(loaded)
"""

SHARED_IMPORT = """
import sys
import tensorshare.protocol.messages, tensorshare.protocol.auth, tensorshare.wire.frames
import tensorshare.wire.description, tensorshare.disk.layout
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("tensorshare_server", "tensorshare._client",
                                                                       "twisted")))
print(loaded)
"""


@pytest.mark.parametrize("script", [SERVER_RUN, SHARED_IMPORT], ids=["server", "shared-modules"])
@pytest.mark.process
def test_modules_load_only_their_own_layer(script):
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
