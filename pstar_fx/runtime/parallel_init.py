"""parallel_init: a model's own init (`init_weights`, `reset_parameters`) run with its `normal_` draws on all host
cores, giving the bits one thread gives.

Where the time goes (measured on the CPU box, torch 2.13): a meta-built model's init is almost all `normal_` on the
host's fp32 masters, and `normal_` is almost all the CPU generator's mt19937 draws (320 M values/s; `zero_` and
`fill_` run at 6 G/s). Those draws are one serial stream: parameter after parameter, element after element. torch's
CPU `normal_` on a contiguous fp32 tensor of n >= 16 values draws n uniforms (n + 16 when n is not a multiple of
16: the last 16 are drawn again) and turns each aligned block of 16 into normals on its own. So a piece of the
tensor that starts at a multiple of 16 gets exactly its values from a generator set to the stream's state at that
element. This mode finds those states by moving the generator's state forward without drawing normals (the C++
`mt19937_advance`: one twist per 624 draws, ~4 G draws/s on the development VM; without it, by the cheapest op that
draws the same stream, `random_` on int64: two draws per value, 1.2 G draws/s here and ~0.5 on the H200 box, where
it bounded the init at 501 M values/s on 16 threads), and hands each piece, with its state, to a worker thread
that runs the same `normal_` on it. The global generator ends where one thread leaves it, so whatever the init draws
next (a `uniform_`, another `normal_`) is unchanged. Every other op runs as it is, in order, after waiting for any
pending piece whose memory it touches.

With the C++ advance the advancing thread is nearly idle (a piece's advance costs a tenth of its fill or less:
4.6 G draws/s against 0.3-0.5 G values/s, development VM), so
k threads fill beside it on k cores: up to k x faster (1.81x on the 2-core development VM, `bench/init_speed.py
--model GPT3_18B --layers 3 --threads 2`). Drawing through instead, one thread advances and k - 1 fill: the wall
time is about max(draws / advance rate, draws / ((k - 1) * 320 M/s)), up to 3.7x at 16 cores, 1.6x at 3, nothing at
2 (so it stays off there: MIN_THREADS). The layout of draws is checked once per
process against a plain `normal_` (`same_bits_as_serial`); where a torch build draws otherwise, the init runs on
one thread as before. Limit: only ops that reach the dispatcher wait for pending pieces; an init that reads a
weight's memory behind torch's back (`.numpy()`, a raw pointer) could see it unwritten.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import parse_count

log = logging.getLogger("pstar_fx")

aten = torch.ops.aten

PIECE_ELEMS = 1 << 22          # 16 MiB of fp32 per worker task: ~13 ms of normal_ here, small next to a big matrix
MIN_ELEMS = 1 << 16            # smaller tensors run in place: a piece's state copy would cost more than it saves
MIN_THREADS = 3                # drawing through: with 2, one thread advancing and one filling is one thread's time
_SCRATCH_ELEMS = 1 << 21       # int64 values the advance draws into at a time (16 MiB)
HANDOFF_S = 2e-4               # the interpreter's switch interval while an init runs beside this process's Python


def _advance(gen: torch.Generator, draws: int, scratch: torch.Tensor) -> None:
    """Move `gen` forward by `draws` 32-bit draws without computing normals: its state moved by the C++ kernel
    (`mt19937_advance`, ~4 G draws/s on the development VM) where that is built and agrees with drawing here;
    else by drawing, int64 `random_` taking two per value."""
    move = _state_mover()
    if move is not None:
        _move_state(gen, move, draws)
    else:
        _draw_through(gen, draws, scratch)


def _move_state(gen: torch.Generator, move: Callable[[int, int], None], draws: int) -> None:
    state = gen.get_state()
    move(state.data_ptr(), draws)
    gen.set_state(state)


def _draw_through(gen: torch.Generator, draws: int, scratch: torch.Tensor) -> None:
    pairs, odd = divmod(draws, 2)
    while pairs:
        n = min(pairs, scratch.numel())
        scratch[:n].random_(generator=gen)
        pairs -= n
    if odd:
        scratch.view(torch.float32)[:1].uniform_(generator=gen)     # one draw per fp32 value


@functools.cache
def _state_mover() -> Callable[[int, int], None] | None:
    """The C++ `mt19937_advance` (kernels/csrc/cpu_adam.cpp), or None where it is not built or moves a state
    otherwise than drawing does in this torch (checked once per process across twist boundaries)."""
    from ..kernels import cpu_adam
    move = getattr(cpu_adam.extension(), "mt19937_advance", None)
    if move is None:
        return None
    scratch = torch.empty(1024, dtype=torch.int64)
    try:
        for start, draws in ((0, 0), (0, 1), (1, 623), (5, 1248), (700, 625), (3, 20001)):
            drawn, moved = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
            _draw_through(drawn, start, scratch)
            _draw_through(moved, start, scratch)
            _draw_through(drawn, draws, scratch)
            _move_state(moved, move, draws)
            if not torch.equal(drawn.get_state(), moved.get_state()):
                raise ValueError(f"{draws} draws from {start}")
    except (ValueError, RuntimeError) as e:
        log.info("the generator is moved forward by drawing: mt19937_advance disagrees here (%s)", e)
        return None
    return move


@functools.cache
def _redraws_last_block(dtype: torch.dtype) -> bool | None:
    """Whether a CPU `normal_` of n >= 16 contiguous `dtype` values, n not a multiple of 16, takes n + 16 draws (its
    last block of 16 drawn again: fp32, and the 16-bit dtypes up to torch 2.11) or n rounded up to 16 (the 16-bit
    dtypes in later torch); None where it takes neither. Probed once per process: on the H200 box's torch 2.11 a
    16-bit rule assumed from 2.13 failed the bits check, and a 70B LoRA's 26 G frozen host weights were drawn on one
    thread (more than 6 minutes)."""
    n = 16 * 3 + 5
    gen = torch.Generator().manual_seed(7)
    start = gen.get_state()
    torch.empty(n, dtype=dtype).normal_(generator=gen)
    end = gen.get_state()
    scratch = torch.empty(64, dtype=torch.int64)
    for redraw, draws in ((True, n + 16), (False, n + 16 - n % 16)):
        probe = torch.Generator()
        probe.set_state(start)
        _draw_through(probe, draws, scratch)
        if torch.equal(probe.get_state(), end):
            return redraw
    return None


def _draws(n: int, dtype: torch.dtype = torch.float32) -> int:
    """32-bit draws a CPU `normal_` of n >= 16 contiguous values takes: n when n is a multiple of 16; else n + 16 or
    n rounded up to 16, as this torch draws into `dtype` (`_redraws_last_block`)."""
    if n % 16 == 0:
        return n
    return n + 16 if _redraws_last_block(dtype) else n + 16 - n % 16


def _pieces(n: int, piece: int) -> list[tuple[int, int]]:
    """[start, end) pieces of n values, each starting at a multiple of 16 and none shorter than 16."""
    piece = max(16, piece - piece % 16)
    out = []
    start = 0
    while start < n:
        end = min(start + piece, n)
        if n - end < 16:
            end = n
        out.append((start, end))
        start = end
    return out


def _fill(view: torch.Tensor, mean: float, std: float, state: torch.Tensor) -> None:
    gen = torch.Generator()
    gen.set_state(state)
    view.normal_(mean, std, generator=gen)


def same_bits_as_serial() -> bool:
    """Whether this torch's CPU `normal_` draws as the module docstring says: pieces with their states give the bits
    of one call, and the generator ends at the same state (checked on a few hundred values, once per process)."""
    return _same_bits_for(torch.float32)


SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # 16-bit: a frozen chunk's weights, on the host


@functools.cache
def _same_bits_for(dtype: torch.dtype) -> bool:
    """`same_bits_as_serial` for a `normal_` into `dtype` (how a 16-bit one draws differs between torch versions:
    checked here, not assumed). A 16-bit dtype that does not split is said once (fp32's caller says it)."""
    same = _redraws_last_block(dtype) is not None and _pieces_give_serial_bits(dtype)
    if not same and dtype != torch.float32:
        log.info("normal_ into %s host tensors runs on one thread: this torch's CPU normal_ into it does not split "
                 "with the same bits", str(dtype).removeprefix("torch."))
    return same


def _pieces_give_serial_bits(dtype: torch.dtype) -> bool:
    n, piece = 16 * 23 + 5, 64
    gen = torch.Generator().manual_seed(1234)
    start = gen.get_state()
    whole = torch.empty(n, dtype=dtype).normal_(0.5, 2.0, generator=gen)
    end = gen.get_state()
    gen.set_state(start)
    parts = torch.empty(n, dtype=dtype)
    scratch = torch.empty(8, dtype=torch.int64)
    for a, b in _pieces(n, piece):
        _fill(parts[a:b], 0.5, 2.0, gen.get_state())
        _advance(gen, _draws(b - a, dtype) if b == n else b - a, scratch)
    return torch.equal(whole, parts) and torch.equal(end, gen.get_state())


def _byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of the memory `t` can touch (torch strides are never negative)."""
    if t.numel() == 0:
        return (0, 0, 0)
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (t.untyped_storage().data_ptr(), t.data_ptr(), t.data_ptr() + extent * t.element_size())


class _SplitNormal(TorchDispatchMode):
    """Large host fp32 or 16-bit (a frozen chunk's weights) `normal_` calls on the global generator: split into
    pieces run by `pool` (None: none split), in the order of one thread's draws; every other op waits for the
    pending pieces it overlaps. `progress` is called with the values written in place so far (whatever the op: a
    progress count, not an exact one)."""

    def __init__(self, pool: ThreadPoolExecutor | None, piece_elems: int,
                 progress: Callable[[int], None] | None = None,
                 generators: dict[torch.device, torch.Generator] | None = None):
        super().__init__()
        self.pool, self.piece_elems, self.progress = pool, piece_elems, progress
        self.generators = generators or {}
        self.written = 0
        self.pending: list[tuple[tuple[int, int, int], list[Future]]] = []
        self.scratch = torch.empty(_SCRATCH_ELEMS, dtype=torch.int64)
        self.split_elems = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.generators and kwargs.get("generator") is None:
            drawing = func if _takes_generator(func) else _with_generator(func)
            gen = self.generators.get(_device_of(args, kwargs)) if drawing is not None else None
            if gen is not None:                     # the block's own generator instead of the global one
                func, kwargs = drawing, {**kwargs, "generator": gen}
        if self.progress is not None and args and isinstance(args[0], torch.Tensor) \
                and func._schema.name.endswith("_"):
            self.written += args[0].numel()
            self.progress(self.written)
        if self.pool is not None and func is aten.normal_.default and self._splittable(args, kwargs):
            t = args[0]
            self._wait_for(t)                       # an earlier pending write to the same values lands first
            mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
            std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
            self._split(t, mean, std, kwargs.get("generator") or torch.default_generator)
            return t
        if self.pending and not func.is_view:
            for x in tree_leaves((args, kwargs)):
                if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                    self._wait_for(x)
        return func(*args, **kwargs)

    def _splittable(self, args, kwargs) -> bool:
        t = args[0]
        gen = kwargs.get("generator")
        return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" \
            and t.dtype in SPLIT_DTYPES and t.is_contiguous() and t.numel() >= MIN_ELEMS \
            and (gen is None or gen is self.generators.get(torch.device("cpu"))) and _same_bits_for(t.dtype)

    def _split(self, t: torch.Tensor, mean: float, std: float, gen: torch.Generator) -> None:
        flat = t.view(-1)
        n = flat.numel()
        futures = []
        for a, b in _pieces(n, self.piece_elems):
            futures.append(self.pool.submit(_fill, flat[a:b], mean, std, gen.get_state()))
            _advance(gen, _draws(b - a, t.dtype) if b == n else b - a, self.scratch)
        self.pending.append((_byte_range(t), futures))
        self.split_elems += n

    def _wait_for(self, t: torch.Tensor) -> None:
        store, lo, hi = _byte_range(t)
        if not self.pending or hi == lo:
            return
        if any(s == store and lo < e and b < hi for (s, b, e), _ in self.pending):
            self.wait()

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for _, futures in pending:
            for f in futures:
                f.result()


def _takes_generator(func) -> bool:
    return any(a.name == "generator" and a.kwarg_only for a in func._schema.arguments)


# a factory's overload without a generator -> its overload with one (aten.randn.default -> aten.randn.generator)
_GENERATOR_OVERLOADS = {"default": "generator", "low": "low_generator"}


def _with_generator(func):
    """The overload of random factory `func` (randn, rand, randint, randperm) that takes a generator, else None."""
    name = _GENERATOR_OVERLOADS.get(func._overloadname)
    other = getattr(func.overloadpacket, name, None) if name else None
    if other is None or not _takes_generator(other):
        return None
    given = [a.name for a in func._schema.arguments]
    return other if [a.name for a in other._schema.arguments if a.name != "generator"] == given else None


def _device_of(args, kwargs) -> torch.device | None:
    """The device a random op draws on: its first tensor argument's (in place), else its `device` keyword (a
    factory: randn, rand, randperm, ...), else the CPU."""
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    device = t.device if t is not None else torch.device(kwargs.get("device") or "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def own_generators(seed: int, device: torch.device) -> dict[torch.device, torch.Generator]:
    """Generators of this CPU and of `device` (if CUDA), each in the state `torch.manual_seed(seed)` puts the global
    one in: an init drawing from these draws what it would from the global ones, while another thread (Dynamo
    saves and restores the global generators around each compile) may use those."""
    gens = {torch.device("cpu"): torch.Generator().manual_seed(seed)}
    if device.type == "cuda":
        cuda = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        gens[cuda] = torch.Generator(device=cuda).manual_seed(seed)
    return gens


def settle(seed: int, generators: dict[torch.device, torch.Generator]) -> None:
    """The global generators where an init from `torch.manual_seed(seed)` would have left them: seeded (all
    devices, as manual_seed does), then each of `generators`' devices at its generator's state."""
    torch.manual_seed(seed)
    for device, gen in generators.items():
        if device.type == "cpu":
            torch.set_rng_state(gen.get_state())
        else:
            torch.cuda.set_rng_state(gen.get_state(), device)


_handoffs_lock = threading.Lock()
_handoffs_open: list[float] = []     # each open block's interval
_handoffs_before = 0.0               # the interval found when the first of them opened


@contextlib.contextmanager
def prompt_handoffs(seconds: float | None = None):
    """Within the block, a thread waiting for the GIL gets it within `seconds` (HANDOFF_S) of asking, not within
    the interpreter's default 5 ms: for an init on a thread of its own beside this process's own Python work
    (lowering, the regions pass, loading the region builds). The init holds the GIL only between its ops, but it
    asks for it thousands of times (each piece handed out and taken back, each op of the model's init), and
    each time the other thread, busy in Python, keeps it up to the switch interval. On the H200 box a warm
    GPT3_18B's init took 15.0 s beside the region builds against 6.4 s alone (session 18), and ended 2.9 s after
    them; on the 2-core development VM an init of 0.4 G values took 6.0 s alone, 37 s beside a thread busy in
    Python, 5.7 s with a 0.1 ms interval (bench/RESULTS.md, session 26). A shorter interval costs the busy thread
    a switch only when another thread asks, so no more than the init's own demand. The interval found before the
    first of overlapping blocks (compiles on several threads) comes back when the last one ends (a shorter one
    already set is kept)."""
    global _handoffs_before
    with _handoffs_lock:
        if not _handoffs_open:
            _handoffs_before = sys.getswitchinterval()
        mine = min(_handoffs_before, HANDOFF_S if seconds is None else seconds)
        _handoffs_open.append(mine)
        sys.setswitchinterval(min(_handoffs_open))
    try:
        yield
    finally:
        with _handoffs_lock:
            _handoffs_open.remove(mine)
            sys.setswitchinterval(min(_handoffs_open, default=_handoffs_before))


def init_threads() -> int:
    """The threads an init fills on: torch's intra-op threads, or PSTAR_FX_INIT_THREADS (an A/B of the init beside the
    compile's own threads, which it shares the host's cores with: on the H100 box a warm GPT3_18B's init ran at 1.2 G
    values/s on 16 threads beside the compile, against 2.1 alone on the H200 box's 16)."""
    env = os.environ.get("PSTAR_FX_INIT_THREADS")
    return torch.get_num_threads() if env is None else parse_count(env, "PSTAR_FX_INIT_THREADS", "threads", least=1)


@contextlib.contextmanager
def split_normal_draws(threads: int | None = None, piece_elems: int | None = None,
                       progress: Callable[[int], None] | None = None,
                       generators: dict[torch.device, torch.Generator] | None = None):
    """Within the block, large host fp32 or 16-bit `normal_` calls on the global generator run on `threads` threads
    (default: `init_threads()`) with the bits and generator state one thread gives: this one advances the
    generator and `threads` others fill the pieces (`threads` - 1 where the advance draws through the stream, which
    costs a core); the block ends when every value is written. Drawing through, nothing is split with fewer than
    MIN_THREADS threads (the advance would only add work); nothing is split either where this torch draws otherwise
    (`same_bits_as_serial`). `progress(values)`: called as in-place ops write values (for a progress display).
    `generators` (`own_generators`): every random op without a generator of its own draws from the one for its
    device instead of the global one (whose state this block then leaves alone; `settle` moves it after)."""
    threads = threads or init_threads()
    moved = _state_mover() is not None     # the advance costs little: every thread of `threads` fills
    least = min(2, MIN_THREADS) if moved else MIN_THREADS     # (MIN_THREADS below 2: a test splitting on 1 core)
    split = threads >= least and same_bits_as_serial()
    if threads >= least and not split:
        log.info("initialization runs on one thread: this torch's CPU normal_ does not split with the same bits")
    if not split and progress is None and not generators:
        yield None
        return
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(threads if moved else threads - 1,
                                                      thread_name_prefix="pstar_fx-init")) \
            if split else None
        mode = _SplitNormal(pool, piece_elems or PIECE_ELEMS, progress, generators)
        try:
            with mode:
                yield mode
        finally:
            mode.wait()
