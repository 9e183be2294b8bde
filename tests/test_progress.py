"""Progress reports of large transfers (``progress=`` on put, append, get, peek, save)."""

from __future__ import annotations

import pytest
import torch

import tensorshare
from tensorshare._client.progress import PIECE, Progress
from tensorshare.errors import UsageError


def check(reports: list, total: int) -> None:
    assert reports, "no progress reported"
    assert all(t == total for _, t in reports)
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[-1] == total


@pytest.mark.process
def test_large_transfers_report_progress(server, tmp_path):
    value = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: three 4 MiB pieces out, many reads in
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        sent: list = []
        c.put("progress/big", value, progress=lambda d, t: sent.append((d, t)))
        assert len(sent) >= 3
        check(sent, sent[-1][1])
        assert sent[-1][1] > value.numel() * 4  # the whole frame: header and payload
        for call in ("peek", "save", "get"):
            seen: list = []
            if call == "save":
                assert c.save("progress/big", tmp_path / "saved", progress=lambda d, t: seen.append((d, t))) == 1
            else:
                [got] = getattr(c, call)("progress/big", progress=lambda d, t: seen.append((d, t)))
                assert torch.equal(got, value)
            check(seen, 12_000_000)
            assert len(seen) >= 2, (call, seen)
            if call == "peek":
                assert seen[0][0] < 12_000_000  # reported while arriving, not only at the end
        small: list = []
        c.append("progress/small", 1, progress=lambda d, t: small.append((d, t)))
        assert len(small) == 1 and small[0][0] == small[0][1] > 0
        with pytest.raises(UsageError):
            c.put("progress/x", 1, progress="not callable")


def test_pieces_cover_every_byte():
    tracker = Progress(lambda d, t: None, 1)
    parts = [b"h" * 10, memoryview(bytearray(PIECE * 2 + 5)), b"t" * 3]
    pieces = list(tracker.pieces(tracker.sending(parts)))
    assert [sum(map(len, p)) for p in pieces] == [PIECE, PIECE, 18]
    assert b"".join(bytes(x) for p in pieces for x in p) == b"".join(bytes(p) for p in parts)


def test_async_client_refuses_progress():
    from pairing import async_pair

    client, pump, clock, state = async_pair()
    with pytest.raises(UsageError):
        client.put("b", 1, progress=lambda d, t: None)
