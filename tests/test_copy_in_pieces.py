"""runtime/movers.py `copy_in_pieces`: an fp32 host chunk cast into its 16-bit device copy through a staging
buffer, piece by piece. The values are the cast's, and the stream order is what the CUDA runtime needs: recorded
here by test_transaction's stand-in for CudaCopies' streams and events (each piece's copy after the last cast that
read its half of the buffer; each cast after its piece's copy; the event returned is the last cast's)."""
import torch
from test_transaction import StreamLog

from pstar_fx.runtime.movers import copy_in_pieces


def test_on_the_copy_stream_each_cast_before_the_next_piece():
    src = torch.randn(2500)
    dst = torch.empty(2500, dtype=torch.bfloat16)
    streams = StreamLog()
    with streams.on("h2d"):
        assert copy_in_pieces(dst, src, torch.empty(1000), streams) is None
    assert torch.equal(dst, src.to(torch.bfloat16)) and streams.log == []      # one stream: nothing to order


def test_on_a_cast_stream_from_two_halves():
    src = torch.randn(2500)
    dst = torch.empty(2500, dtype=torch.bfloat16)
    streams, done = StreamLog(), [None, None]
    with streams.on("h2d"):
        last = copy_in_pieces(dst, src, torch.empty(1000), streams, done)
    assert torch.equal(dst, src.to(torch.bfloat16))
    # 5 pieces of 500: each copied on h2d (after the cast that last read its half), then cast on "cast"
    copied = [("h2d", n) for op, s, n in streams.log if op == "record" and s == "h2d"]
    cast = [("cast", n) for op, s, n in streams.log if op == "record" and s == "cast"]
    assert len(copied) == len(cast) == 5 and last == cast[-1] and done == [cast[4], cast[3]]
    waits = [e for e in streams.log if e[0] == "wait"]
    assert [e for e in waits if e[1] == "cast"] == [("wait", "cast", ev) for ev in copied]
    # the first two pieces find their halves unread; piece k waits for the cast of piece k - 2
    assert [e for e in waits if e[1] == "h2d"] == [("wait", "h2d", cast[k - 2]) for k in range(2, 5)]
    # a second chunk's first pieces wait for the first chunk's last casts on their halves
    streams.log.clear()
    with streams.on("h2d"):
        copy_in_pieces(dst[:600], src[:600], torch.empty(1000), streams, done)
    assert [e for e in streams.log if e[0] == "wait" and e[1] == "h2d"] == [("wait", "h2d", cast[4]),
                                                                           ("wait", "h2d", cast[3])]
