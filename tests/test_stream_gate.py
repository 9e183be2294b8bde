"""A frame streamed in pieces (a relay's pushed copy) is never interleaved with another, in memory.

While a session streams a frame (``open_stream`` .. ``gate.close``), replies and
notifications made meanwhile wait and follow it in order; ``cut_off`` ends the
connection with the frame cut short and nothing after it.
"""

from __future__ import annotations

from tensorshare.protocol.messages import LISTEN, NOTIFICATION, PUT, Key
from tensorshare.wire.frames import frame_head
from tensorshare_server.bins.store import Change
from tensorshare_server.protocol.gate import open_stream
from pairing import Pair


def streamed_head(nbytes: int) -> bytes:
    return frame_head(NOTIFICATION.build(bin="params", n=1, seq=99, op="INCOMING", tag=7), nbytes)


def test_frames_made_while_a_frame_streams_follow_it():
    pair = Pair()
    pair.call(LISTEN, {Key.BIN: "other"})
    session = pair.session
    gate = open_stream(session)
    assert gate is not None
    assert open_stream(session) is None  # one at a time
    gate.piece([streamed_head(6)])
    gate.piece([memoryview(b"abc")])
    rid = pair.send_request(PUT, {Key.BIN: "other"}, 5)  # its reply and its notification wait
    pair.state.listeners.publish(Change("other", 1, 1000, "PUT", None))
    session.tick(10**9)  # nor may a keepalive come in between
    assert pair.receive() == []  # the frame is not whole yet: nothing decodes
    gate.piece([memoryview(b"def")])
    gate.close()
    frames = pair.receive()
    assert frames[0].header[Key.OP] == "INCOMING" and bytes(frames[0].payload) == b"abcdef"
    assert frames[1].header[Key.ID] == rid and frames[1].header[Key.CODE] == 250
    notes = [f.header for f in frames[2:] if f.header.get(Key.CODE) == 151]
    assert [(n[Key.BIN], n[Key.OP]) for n in notes][-1] == ("other", "PUT")
    assert len(frames) == 2 + len(notes)
    again = open_stream(session)  # free again
    assert again is not None
    again.close()
    pair.close()


def test_a_stream_cut_off_ends_the_connection_with_its_frame_short():
    pair = Pair()
    session = pair.session
    gate = open_stream(session)
    gate.piece([streamed_head(6), memoryview(b"abc")])
    rid = pair.send_request(PUT, {Key.BIN: "other"}, 5)
    session.cut_off("the copy was lost upstream")
    assert pair.outbox.closed and session.closed
    assert pair.receive() == []  # three bytes short: never a whole frame, and nothing after it
    assert pair.client.decoder.payload_remaining == 3
    assert rid  # (its PUT took effect: §8.3; only its reply is lost with the connection)
    assert pair.state.storage.state("other").exists
    pair.close()
