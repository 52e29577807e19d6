"""runtime/movers.py `copy_in_pieces`: an fp32 host chunk cast into its 16-bit device copy through a staging
buffer, piece by piece. The values are the cast's, and the stream order is what the CUDA runtime needs: recorded
here by a stand-in for CudaCopies' streams and events (each piece's copy after the last cast that read its half of
the buffer; each cast after its piece's copy; the event returned is the last cast's)."""
import contextlib

import torch

from pstar_fx.runtime.movers import copy_in_pieces


class Streams:
    """CudaCopies' `on`, `wait` and `record`, as a log of (op, stream, event)."""

    def __init__(self):
        self.current, self.log, self.n = "h2d", [], 0

    @contextlib.contextmanager
    def on(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def record(self):
        self.n += 1
        self.log.append(("record", self.current, self.n))
        return self.n

    def wait(self, event):
        if event is not None:
            self.log.append(("wait", self.current, event))


def test_on_the_copy_stream_each_cast_before_the_next_piece():
    src = torch.randn(2500)
    dst = torch.empty(2500, dtype=torch.bfloat16)
    streams = Streams()
    assert copy_in_pieces(dst, src, torch.empty(1000), streams) is None
    assert torch.equal(dst, src.to(torch.bfloat16)) and streams.log == []      # one stream: nothing to order


def test_on_a_cast_stream_from_two_halves():
    src = torch.randn(2500)
    dst = torch.empty(2500, dtype=torch.bfloat16)
    streams, done = Streams(), [None, None]
    last = copy_in_pieces(dst, src, torch.empty(1000), streams, done)
    assert torch.equal(dst, src.to(torch.bfloat16))
    # 5 pieces of 500: each copied on h2d (after the cast that last read its half), then cast on "cast"
    records = [e for e in streams.log if e[0] == "record"]
    copied = [n for _, s, n in records if s == "h2d"]
    cast = [n for _, s, n in records if s == "cast"]
    assert len(copied) == len(cast) == 5 and last == cast[-1] and done == [cast[4], cast[3]]
    waits = [e for e in streams.log if e[0] == "wait"]
    assert [e for e in waits if e[1] == "cast"] == [("wait", "cast", n) for n in copied]
    # the first two pieces find their halves unread; piece k waits for the cast of piece k - 2
    assert [e for e in waits if e[1] == "h2d"] == [("wait", "h2d", cast[k - 2]) for k in range(2, 5)]
    # a second chunk's first pieces wait for the first chunk's last casts on their halves
    streams.log.clear()
    copy_in_pieces(dst[:600], src[:600], torch.empty(1000), streams, done)
    assert [e for e in streams.log if e[0] == "wait" and e[1] == "h2d"] == [("wait", "h2d", cast[4]),
                                                                           ("wait", "h2d", cast[3])]
