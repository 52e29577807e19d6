"""layout: parameters -> fixed-size chunks, in the order the step first uses them.

A chunk is `chunk_size` elements of each persistent fp32 tensor (master weight, exp_avg, exp_avg_sq) plus,
while in use, a compute copy and a gradient buffer. A parameter lies whole inside one chunk, so the chunk
size is at least the largest parameter. First-use order means forward walks the chunks 0, 1, 2, ... and
backward walks them back, which is what makes a chunk a useful unit to move.

Frozen parameters (no gradient: `requires_grad=False`, or unused by the loss) go into chunks of their own,
"frozen chunks", which hold only the weights in the compute dtype (no master, no moments, no gradient, no
update): a trainable and a frozen parameter never share a chunk. Each kind fills its own open chunk, so the
chunks of both kinds still follow first-use order (LoRA's frozen base weight and its trainable adapters,
interleaved layer by layer, do not cut each other's chunks short). With frozen chunks the chunk size is set by the
largest frozen parameter; a trainable chunk's state (master and moments) is then sized by the fullest trainable
chunk (`Layout.state_elems`), not by the chunk size: LoRA's few trainable parameters do not pay for a chunk made
to hold an embedding. Compute slots stay chunk-sized (they hold either kind).
"""
from __future__ import annotations

from dataclasses import dataclass, field


from .capture import Capture, ParamInfo

_MIN_CHUNKS = 8            # "auto" keeps a model in at least this many chunks when it can
_ALIGN_ELEMS = 1024        # chunk sizes are multiples of 1024 elements (4 KiB of fp32)


@dataclass
class Slot:
    """Where one parameter lives: chunk `chunk`, elements [offset, offset + numel)."""
    index: int                 # position in Capture.params
    param: ParamInfo
    chunk: int
    offset: int

    @property
    def numel(self) -> int:
        return self.param.numel


@dataclass
class Chunk:
    id: int
    slots: list[Slot] = field(default_factory=list)
    used_elems: int = 0
    frozen: bool = False       # its parameters get no gradient: only their weights, in the compute dtype

    def param_spans(self) -> list[tuple[int, int]]:
        """(offset, numel) of each parameter that receives gradients, in slot order (int8 moments quantize each
        parameter by itself)."""
        return [(s.offset, s.numel) for s in self.slots if s.param.has_grad]

    def grad_spans(self) -> list[tuple[int, int]]:
        """Contiguous (offset, numel) ranges of parameters that receive gradients: what Adam updates."""
        spans: list[tuple[int, int]] = []
        for s in self.slots:
            if not s.param.has_grad:
                continue
            if spans and spans[-1][0] + spans[-1][1] == s.offset:
                spans[-1] = (spans[-1][0], spans[-1][1] + s.numel)
            else:
                spans.append((s.offset, s.numel))
        return spans


@dataclass
class Layout:
    chunk_size: int
    chunks: list[Chunk]
    slots: list[Slot]          # indexed like Capture.params
    # elements of a trainable chunk's state (fp32 master, moments): `chunk_size`, or, where frozen chunks set the
    # chunk size, what the fullest trainable chunk holds (`state_elems_for`)
    state_elems: int = 0

    def __post_init__(self):
        self.state_elems = self.state_elems or self.chunk_size

    @property
    def total_elems(self) -> int:
        return self.chunk_size * len(self.chunks)

    @property
    def param_elems(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def waste_elems(self) -> int:
        return self.total_elems - self.param_elems


def first_use_order(cap: Capture) -> list[int]:
    """Indices into Capture.params in the order the graph first reads them; unread parameters last."""
    index = {n: i for i, n in enumerate(cap.param_nodes())}
    order, seen = [], set()
    for node in cap.gm.graph.nodes:
        for arg in node.all_input_nodes:
            i = index.get(arg)
            if i is not None and i not in seen and node.op != "output":
                seen.add(i)
                order.append(i)
    order += [i for i in range(len(cap.params)) if i not in seen]
    return order


def packed_waste(numels: list[int], chunk_size: int) -> tuple[int, int]:
    """(padding elements, chunks) when `numels` are packed in order into chunks of `chunk_size`."""
    chunks, used, waste = 1, 0, 0
    for n in numels:
        if used + n > chunk_size:
            waste += chunk_size - used
            chunks, used = chunks + 1, 0
        used += n
    return waste + chunk_size - used, chunks


def search_chunk_size(numels: list[int], frozen: list[bool] | None = None) -> int:
    """The chunk size between the largest parameter and the smaller of 4x that and 1/8 of the model (so a
    model still splits into several chunks that can move independently) that minimizes (chunks + 1) x size.

    `chunks x size` is the memory the layout takes (parameters plus padding). The `+ 1` prices what a
    larger chunk costs beyond padding: placement moves whole chunks, so on average half a chunk of state
    sits on the host that could have fit on the device, and every chunk-sized compute slot, gradient slot
    and staging buffer on the device grows with it. Least padding alone picked 733M-element chunks for an
    18B GPT (25 chunks: 8 GiB of state per placement decision); this picks 270M (69 chunks).

    PatrickStar's search script scanned 64M..312M elements in 32M steps; here the scan is every 1/64 of
    the largest parameter, in the layout's own first-use order, which costs milliseconds. `frozen` (per
    parameter): trainable and frozen parameters fill chunks of their own, so each kind is packed by itself.
    """
    largest = max(numels)
    lo = -(-largest // _ALIGN_ELEMS) * _ALIGN_ELEMS
    hi = max(lo, min(4 * lo, sum(numels) // _MIN_CHUNKS))
    step = max(_ALIGN_ELEMS, (lo // 64) // _ALIGN_ELEMS * _ALIGN_ELEMS)

    kinds = [numels] if not frozen else [[n for n, f in zip(numels, frozen) if f == kind] for kind in (False, True)]
    kinds = [k for k in kinds if k]

    def cost(size: int) -> int:
        return (sum(packed_waste(k, size)[1] for k in kinds) + 1) * size

    return min(range(lo, hi + 1, step), key=lambda size: (cost(size), size))


def build_layout(cap: Capture, chunk_size: int | str = "auto") -> Layout:
    if not cap.params:
        raise ValueError("the model has no parameters to train")
    if chunk_size == "auto":
        order = first_use_order(cap)
        chunk_size = search_chunk_size([cap.params[i].numel for i in order],
                                       [not cap.params[i].has_grad for i in order])
    largest = max(cap.params, key=lambda p: p.numel)
    if largest.numel > chunk_size:
        raise ValueError(f"chunk_size={chunk_size} elements is smaller than parameter {largest.name!r} "
                         f"({largest.numel} elements); every parameter must fit in one chunk")
    if not any(p.has_grad for p in cap.params):
        raise ValueError("every parameter is frozen (requires_grad=False, or unused by the loss): there is nothing "
                         "to train; set requires_grad=True on the parameters to train")
    chunks: list[Chunk] = []
    open_chunk: dict[bool, Chunk] = {}         # frozen? -> the chunk that kind of parameter fills now
    slots: list[Slot | None] = [None] * len(cap.params)
    for i in first_use_order(cap):
        p = cap.params[i]
        frozen = not p.has_grad
        c = open_chunk.get(frozen)
        if c is None or c.used_elems + p.numel > chunk_size:
            c = open_chunk[frozen] = Chunk(len(chunks), frozen=frozen)
            chunks.append(c)
        slots[i] = Slot(i, p, c.id, c.used_elems)
        c.slots.append(slots[i])
        c.used_elems += p.numel
    return Layout(chunk_size, chunks, slots, state_elems_for(chunks, chunk_size))


def state_elems_for(chunks: list[Chunk], chunk_size: int) -> int:
    """Elements of each trainable chunk's state. With frozen chunks the chunk size is set by the largest frozen
    parameter (a 70B model's 1.05 G-element embedding), and the trainable parameters (LoRA's 207 M) may fill only a
    part of one chunk: their state is sized by the fullest trainable chunk (rounded up to whole 4 KiB), not by the
    chunk size (at 70B LoRA r=16: 2.5 GB of fp32 master and moments, not 13). Without frozen chunks, the chunk
    size."""
    trainable = [ch.used_elems for ch in chunks if not ch.frozen]
    if len(trainable) == len(chunks) or not trainable:
        return chunk_size
    return min(chunk_size, -(-max(trainable) // _ALIGN_ELEMS) * _ALIGN_ELEMS)

