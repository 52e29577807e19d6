"""costs: how long things take on this machine — a short calibration, cached, and a per-node time estimate.

The planner needs two kinds of time: a chunk copy (bytes / link bandwidth) and the compute it can hide
behind (the nodes between a prefetch and the use). Node time is estimated from fake-tensor metadata: the
longer of an op's FLOPs at the measured matmul rate (matmuls, attention, convolutions; zero for the rest) and
its bytes read and written at the measured memory bandwidth. Rates come from a calibration of a second or
so, cached per device in ~/.cache/pstar_fx/ (PSTAR_FX_CACHE overrides); `Rates.nominal(device)` gives fixed
figures when no measurement is possible (planning for a CUDA device on a machine without one). The host rates
are the C++ kernels' in the engine's configuration: the host Adam by moment dtype, and the host correction (an undo
and redo, what a kept_grads step runs when clipping triggers).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from ..fxutil import aliases_input, op_of

aten = torch.ops.aten


# The Rates field of the host Adam's rate for each Config.optimizer_state
HOST_ADAM_FIELD = {"fp32": "host_adam", "bf16": "host_adam_bf16", "int8": "host_adam_int8"}


@dataclass
class Rates:
    device: str
    flops: float           # matmul FLOP/s in the compute dtype
    mem_bw: float          # device memory bytes/s (read + write)
    h2d_bw: float          # host -> device bytes/s
    d2h_bw: float          # device -> host bytes/s
    host_adam: float       # host Adam parameters/s (all cores), fp32 moments
    workspace_bytes: int = 0   # device bytes the libraries keep once used (cuBLAS/cuBLASLt workspaces)
    # a collective's bus bandwidth between data-parallel ranks (bytes/s each rank moves in a ring broadcast or
    # reduce); 0: not measured, the nominal figure for the device is used
    coll_bw: float = 0.0
    # host Adam parameters/s with bf16 and with int8 moments (Config.optimizer_state); 0: not measured, the fp32
    # figure stands in. int8's (de)quantization costs compute: 2.5x fewer parameters/s than fp32 (2-core AVX2 VM)
    host_adam_bf16: float = 0.0
    host_adam_int8: float = 0.0
    # the host correction's parameters/s (kernels adam_rescale: a speculative update made again with the clip
    # coefficient in one pass; fp32 moments: bf16 and int8 moments are never corrected); 0: not measured (Rates
    # made without it), the fp32 host Adam's rate stands in (the correction moves its bytes; the undo-then-redo
    # before it ran at 0.96x of it on the H200 host, bench/host_undo_bench.py)
    host_undo: float = 0.0

    def __post_init__(self):
        if not self.coll_bw:
            self.coll_bw = NOMINAL_COLL_BW["cpu" if self.device.startswith("cpu") else "cuda"]

    def host_adam_with(self, optimizer_state: str) -> float:
        """Host Adam parameters/s with moments stored as `optimizer_state` ("fp32", "bf16", "int8")."""
        return getattr(self, HOST_ADAM_FIELD.get(optimizer_state, "host_adam")) or self.host_adam

    @property
    def host_correction(self) -> float:
        """Host correction parameters/s (`host_undo`, or the fp32 host Adam's rate where it was not measured)."""
        return self.host_undo or self.host_adam

    @staticmethod
    def nominal(device: torch.device) -> "Rates":
        if device.type == "cuda":  # one H200 (shared/reference/h200.md): bf16 matmul, HBM copy, pinned PCIe
            return Rates("cuda-nominal", 790e12, 4.2e12, 55e9, 55e9, 4.0e9, 32 * 2**20, host_undo=0.96 * 4.0e9)
        return Rates("cpu-nominal", 5e10, 1e10, 1e10, 1e10, 1.0e9, host_undo=0.96 * 1.0e9)


# Host memory bytes the host Adam moves per parameter, by moments (master read and written 8, moments read and
# written 2x2x their size, the 16-bit gradient read 2 and the 16-bit shadow written 2): measured on the H200 host as
# its counted traffic over its rate, 154 GB/s at 5.50 G params/s with fp32 moments and 134.6 at 6.73 with bf16
# (bench/RESULTS.md, session 8). int8 moments: 1 B each and their scales, taken as 16.
HOST_ADAM_BYTES = {"fp32": 28, "bf16": 20, "int8": 16}
# the least share of its own rate the host Adam keeps beside copies in this model (it is never starved outright)
HOST_ADAM_MIN_SHARE = 0.25


def host_adam_share(rate: float, optimizer_state: str, copy_bytes_per_s: float) -> float:
    """The share of its rate alone the host Adam runs at while PCIe copies move `copy_bytes_per_s` through host
    memory. The host Adam alone takes the host's memory bandwidth (rate x bytes per parameter); DMA both ways takes
    its bytes from the same memory, and the Adam gets the rest. Measured on the H200 host (session 8): copies
    moving 70.6 GB/s beside it left the fp32 Adam 0.63x of its rate alone (this model: 0.54x); in a GPT3_18B step
    moving ~25 GB/s it ran at 5.17 G params/s against 6.27 alone (this model: 5.38; session 14)."""
    if copy_bytes_per_s <= 0 or rate <= 0:
        return 1.0
    own = rate * HOST_ADAM_BYTES.get(optimizer_state, HOST_ADAM_BYTES["fp32"])
    return max(HOST_ADAM_MIN_SHARE, 1.0 - copy_bytes_per_s / own)


# Assumed, not measured here (no multi-GPU machine has been lent): NCCL's ring bus bandwidth between the H200s of
# one NVLink host, well under NVLink 4's 450 GB/s each way; gloo between processes of one CPU host
NOMINAL_COLL_BW = {"cuda": 300e9, "cpu": 2e9}


_MEASURED: dict[str, Rates] = {}     # this process's measurements, when the cache cannot be written


def cache_root() -> str:
    """The folder of pstar_fx's on-disk caches (rates here, plans in pipeline/plan_cache.py): PSTAR_FX_CACHE, or
    ~/.cache/pstar_fx."""
    return os.environ.get("PSTAR_FX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pstar_fx")


@contextlib.contextmanager
def written_aside(path: str):
    """A name beside `path` to write, renamed to `path` once written (a reader never sees half); removed if the
    writing fails. Every on-disk cache writes its entries so (plans, reserves, regions' measured memory and
    artifacts)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.tmp-{os.getpid()}"
    try:
        yield part
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)


def write_entry(path: str, entry) -> None:
    """`entry` as JSON at `path`, written aside (`written_aside`); OSError where it cannot be."""
    with written_aside(path) as part, open(part, "w") as f:
        json.dump(entry, f)


def _cache_path(key: str) -> str:
    return os.path.join(cache_root(), f"rates-v9-{key}.json")     # v9: the matmul timed in sustained windows


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu{os.cpu_count()}-t{torch.get_num_threads()}"
    return "".join(c if c.isalnum() else "_" for c in name)


# Figures a caller states instead of measuring (`assumed`): one dict per context, so threads and nested blocks
# each see their own; None outside any `with assumed(...)`.
_ASSUMED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pstar_fx_assumed_rates", default=None)


@contextlib.contextmanager
def assumed(**figures: float):
    """Within the block, `calibrate` returns its rates with these fields of `Rates` replaced, e.g.
    `with assumed(coll_bw=45e9): pstar_fx.plan(...)` plans for ranks joined by 45 GB/s of collective bus
    bandwidth (InfiniBand between hosts) rather than the nominal NVLink figure. For sizing a machine that is
    not this one (`pstar-fx plan --coll-bw`); the cache's measurements are left as they are, and an engine
    launched on partitioned ranks still measures its own bus bandwidth (pipeline.lower.Lowered._rates). An unknown
    field is a TypeError that lists the valid ones."""
    names = [f.name for f in dataclasses.fields(Rates) if f.name != "device"]
    unknown = sorted(set(figures) - set(names))
    if unknown:
        raise TypeError(f"assumed(): unknown rate(s) {', '.join(unknown)}; choose from: {', '.join(names)}")
    token = _ASSUMED.set({**(_ASSUMED.get() or {}), **figures})
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def calibrate(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Rates:
    """Measured rates for `device`, from the cache when present (`Rates.nominal` for a CUDA device this
    machine lacks), with the host Adam's rates that training measured here written over the calibration's
    (`learn_host_rate`), and the figures of an enclosing `assumed(...)` over those."""
    rates = _with_learned(_calibrated(device, dtype), device, dtype)
    figures = _ASSUMED.get()
    return dataclasses.replace(rates, **figures) if figures else rates


def calibrated_rates(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Rates:
    """The calibration's rates for `device` as measured, without what training taught (`calibrate` gives those)."""
    return _calibrated(device, dtype)


def learning_host_rates() -> bool:
    """Whether training corrects the host Adam's calibrated rates for later plans (`PSTAR_FX_LEARN_RATES`,
    default 1; runtime/host_rate.py)."""
    from ..config import parse_flag
    return parse_flag(os.environ.get("PSTAR_FX_LEARN_RATES", "1"), "PSTAR_FX_LEARN_RATES")


def _learned_path(key: str) -> str:
    return os.path.join(cache_root(), f"host-rates-v1-{key}.json")


def learned_host_rates(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """The host Adam's rates alone, parameters/s by moments, as training on this machine measured them (empty
    where it has not, or learning is off): what `calibrate` gives in place of the calibration's."""
    if device.type != "cuda" or not torch.cuda.is_available() or not learning_host_rates():
        return {}
    try:
        with open(_learned_path(_rates_key(device, dtype))) as f:
            entry = json.load(f)
        return {k: float(v) for k, v in entry.items() if k in HOST_ADAM_FIELD and float(v) > 0}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def learn_host_rate(device: torch.device, dtype: torch.dtype, optimizer_state: str, rate: float) -> None:
    """Remember `rate` (parameters/s alone, as `Rates.host_adam_with` gives) for the host Adam with these moments
    on this machine: later plans here use it (`calibrate`). CUDA only: on the CPU tier the host Adam shares its
    cores with the compute, and the rate a run sees says more about that run than about the machine."""
    if (device.type != "cuda" or not torch.cuda.is_available() or optimizer_state not in HOST_ADAM_FIELD
            or not rate > 0):
        return
    path = _learned_path(_rates_key(device, dtype))
    entry = {**learned_host_rates(device, dtype), optimizer_state: float(rate)}
    try:
        write_entry(path, entry)
    except OSError:
        pass                                # a read-only home: this run's plan stays the calibration's


def _with_learned(rates: Rates, device: torch.device, dtype: torch.dtype) -> Rates:
    learned = learned_host_rates(device, dtype)
    return dataclasses.replace(rates, **{HOST_ADAM_FIELD[k]: v for k, v in learned.items()}) if learned else rates


def _rates_key(device: torch.device, dtype: torch.dtype) -> str:
    return _device_key(device) + "-" + str(dtype).split(".")[-1]


# children measuring a GPU's rates, started before they are needed (`start_calibration`), by rates key
_CHILDREN: dict[str, subprocess.Popen] = {}


def start_calibration(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """Start measuring a GPU's rates in a child process now when they are neither known here nor cached, so that
    the measurement (a fresh process, CUDA, host Adam over 512 MiB buffers: seconds) runs beside the capture
    instead of after it; `calibrate` takes the child's result."""
    key = _rates_key(device, dtype) if needs_calibration(device, dtype) else None
    if key is not None and key not in _CHILDREN:
        _CHILDREN[key] = _child(device, dtype, key)


def needs_calibration(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a compile now would measure `device`'s rates (a GPU whose rates are neither known here nor cached;
    startup.standby_builders starts no workers beside that measurement)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    key = _rates_key(device, dtype)
    return key not in _MEASURED and not os.path.exists(_cache_path(key))


def _child(device: torch.device, dtype: torch.dtype, key: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pstar_fx.planning.costs", str(device), str(dtype).split(".")[-1],
                             key], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@atexit.register
def _stop_children() -> None:
    """(a compile that failed before its plan leaves no child measuring)"""
    for child in _CHILDREN.values():
        child.kill()
    _CHILDREN.clear()


def _calibrated(device: torch.device, dtype: torch.dtype) -> Rates:
    """Measured rates for `device`, from the cache when present. A GPU is measured in a child process: its
    benchmark tensors (hundreds of MiB) must not count in this process's memory or its peak statistics,
    which the plan promises to stay under."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return Rates.nominal(device)
    key = _rates_key(device, dtype)
    if key in _MEASURED:
        return _MEASURED[key]
    path = _cache_path(key)
    try:
        with open(path) as f:
            rates = Rates(**json.load(f))
        if key in _CHILDREN:                # another process cached them meanwhile
            _CHILDREN.pop(key).kill()
        return rates
    except (OSError, ValueError, TypeError):
        pass
    rates = _measure_in_child(device, dtype, key) if device.type == "cuda" else _measure(device, dtype, key)
    _MEASURED[key] = rates
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(rates), f)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return rates


def _timeit(fn, device: torch.device, reps: int = 3, at_least: float = 0.0) -> float:
    """The best of `reps` timed runs after one warm-up, and of more until they took `at_least` seconds."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    best, spent, k = float("inf"), 0.0, 0
    while k < reps or spent < at_least:
        t0 = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - t0
        best, spent, k = min(best, took), spent + took, k + 1
    return max(best, 1e-9)


def _sustained(fn, device: torch.device, window: float = 0.05, windows: int = 3) -> float:
    """Seconds per call of `fn` with the device kept busy: calls back to back in windows of at least `window` seconds,
    the best of `windows` after uncounted ones that bring an idle GPU's clocks up (`_timeit`'s warm-up, one window
    each). A step's matmuls run for seconds on end, so that is the rate the plan needs: the best of three single
    4096-cube matmuls (about 0.2 ms each on an H200) read 630 and 723 TFLOPs in two fresh processes of one machine,
    minutes apart, where the step ran at what 690 predicts (bench/RESULTS.md, session 37)."""
    sized = lambda seconds: max(1, math.ceil(window / seconds))  # noqa: E731  (calls that fill a window)
    burst = lambda calls: lambda: [fn() for _ in range(calls)]  # noqa: E731
    calls = sized(_timeit(fn, device, reps=1))
    # sized again at the clocks a window brings up (one call timed alone ran slower, which made the windows short)
    calls = max(calls, sized(_timeit(burst(calls), device, reps=1) / calls))
    return _timeit(burst(calls), device, reps=windows) / calls


def _matmul_operand(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The square matrix the calibration multiplies by itself: 4096 in the compute dtype on a GPU, 512 in fp32 on the
    CPU tier (for the test machines' time)."""
    n = 4096 if device.type == "cuda" else 512
    return torch.randn(n, n, device=device, dtype=dtype if device.type == "cuda" else torch.float32)


def _measure_in_child(device: torch.device, dtype: torch.dtype, key: str) -> Rates:
    """The rates a child process measures: the one `start_calibration` started, else one started now."""
    try:
        child = _CHILDREN.pop(key, None) or _child(device, dtype, key)
        try:
            out, err = child.communicate(timeout=300)
        finally:
            child.kill()                    # (a no-op once it has exited)
        if child.returncode:
            raise subprocess.CalledProcessError(child.returncode, child.args, out, err)
        return Rates(**json.loads(out.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, OSError, ValueError, TypeError, IndexError) as e:
        import logging
        logging.getLogger("pstar_fx").warning(
            "measuring %s's rates in a child process failed (%s); measuring here instead, so this process's "
            "peak GPU memory statistics include the benchmark's tensors", device, e)
        rates = _measure(device, dtype, key)
        torch.cuda.empty_cache()
        return rates


def _workspace_bytes(device: torch.device, dtype: torch.dtype) -> int:
    """What the first matmuls of a process leave allocated besides their results: cuBLAS and cuBLASLt
    workspaces (per handle, kept for the process's life). Measured first thing in a fresh process."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.ones(64, 64, device=device, dtype=dtype)
    bias = torch.ones(64, device=device, dtype=dtype)
    outs = [a @ a, torch.addmm(bias, a, a), torch.bmm(a[None], a[None]), a.float() @ a.float()]
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before
    return max(0, kept - sum(-(-t.nbytes // 512) * 512 for t in [a, bias, *outs]))


def _measure(device: torch.device, dtype: torch.dtype, key: str) -> Rates:
    workspace = _workspace_bytes(device, dtype) if device.type == "cuda" else 0
    a = _matmul_operand(device, dtype)
    flops = 2 * a.shape[0]**3 / _sustained(lambda: a @ a, device)
    elems = (64 if device.type == "cuda" else 8) * 2**20
    x = torch.empty(elems, device=device)
    y = torch.empty_like(x)
    mem_bw = 2 * x.nbytes / _timeit(lambda: y.copy_(x), device)
    pin = device.type == "cuda"
    h = torch.empty(elems, pin_memory=pin)
    h2d = x.nbytes / _timeit(lambda: x.copy_(h, non_blocking=pin), device)
    d2h = x.nbytes / _timeit(lambda: h.copy_(x, non_blocking=pin), device)
    # a GPU box's host has a large last-level cache (2**24 elements fit); the CPU tier's host Adam is timed
    # smaller, for the test machines' time and memory. On the H200 box the bf16-moment Adam timed 11.6 G params/s
    # over 2**24 elements, 8.7-10.4 over 2**26, 7.56 over 2**27 (bench/box_limits.py), and ran at 6.5 in training
    # (a chunk: 2**28); fp32 moments 5.78 over 2**26, 5.68 over 2**27 (bench/RESULTS.md, session 24)
    n = 2**27 if device.type == "cuda" else 2**24
    from pstar_fx.kernels import cpu_adam
    # with the threads the runtime gives it: the CUDA runtime's host worker leaves a core to the launching thread
    cpu_adam.set_threads(cpu_adam.worker_threads() if device.type == "cuda" else 0)
    try:
        adam = {state: _host_adam_rate(state, dtype, n) for state in ("fp32", "bf16", "int8")}
        undo = _host_undo_rate(dtype, n)
    finally:
        cpu_adam.set_threads(0)
    return Rates(key, flops, mem_bw, h2d, d2h, adam["fp32"], workspace, host_adam_bf16=adam["bf16"],
                 host_adam_int8=adam["int8"], host_undo=undo)


def _host_adam_rate(state: str, dtype: torch.dtype, n: int, at_least: float = 0.25) -> float:
    """Host Adam parameters/s over `n` elements with moments stored as `state`, as the engine runs it: the
    gradient in the compute dtype, the 16-bit copy written when the compute is 16-bit, no non-finite pass (the
    device measures each host chunk's gradient before it leaves); the best of repeats over at least `at_least`
    seconds. `n` must put the state out of the last-level cache, as a chunk's is: on the H200 box 2**24 elements
    (192-256 MB) calibrated bf16 moments at 11.6 G params/s where training then ran them at 5.5, and three
    repeats of about 10 ms each let one passing disturbance spoil them all (1.12 G params/s read for int8
    moments that training on the same box ran at 3.3)."""
    from pstar_fx.kernels import adam_step, quant8
    gen = torch.Generator().manual_seed(0)
    p = _drawn(n, gen)
    g = _drawn(n, gen, dtype=dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
    out = torch.empty(n, dtype=g.dtype) if g.dtype != torch.float32 else None
    scales = {}
    if state == "int8":
        m = torch.full((n,), quant8.SIGNED_ZERO, dtype=torch.uint8)
        v = torch.zeros(n, dtype=torch.uint8)
        scales = dict(exp_avg_absmax=torch.zeros(quant8.blocks(n)), exp_avg_sq_absmax=torch.zeros(quant8.blocks(n)))
    else:
        moments = torch.bfloat16 if state == "bf16" else torch.float32
        m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    return n / _timeit(lambda: adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.0, param_out=out, check_finite=False, **scales),
                       torch.device("cpu"), at_least=at_least)


CALIBRATION_BLOCK = 2**20


def _drawn(n: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, scale: float = 1.0,
           shift: float = 0.0) -> torch.Tensor:
    """`n` values uniform in [shift, shift + scale), as `dtype`: a block of `CALIBRATION_BLOCK` drawn, then repeated.
    The host kernels timed here do the same work per element on any such values, and torch.rand draws on one
    thread: a calibration drew 2**27 ten times (0.67 s each on the 2-core development VM, the block repeated 0.37
    s; on a 16-core host the repeat runs on all of them), while the compile it runs beside waited for its rates."""
    block = (torch.rand(min(n, CALIBRATION_BLOCK), generator=gen) * scale + shift).to(dtype)
    return block.repeat(-(-n // block.numel()))[:n]


def _host_undo_rate(dtype: torch.dtype, n: int, at_least: float = 0.25) -> float:
    """Host correction parameters/s over `n` elements, as the engine runs one (runtime/undo.py `_correct_one`): the
    speculative update made again with the verdict's scale in one fp32 pass (kernels adam_rescale), fp32 moments,
    the kept gradient in the compute dtype and the 16-bit copy written when the compute is 16-bit; the sizes,
    threads and repeats of `_host_adam_rate`. AdamW at the Config defaults, a step past the first (the first takes
    the moments from zeros, computing less), and grad scales that are no power of two (the guessed and the true
    clip coefficients are not: the kernel divides by them), the same for the guess and the verdict, so that repeats
    leave the state about where it was."""
    from pstar_fx.kernels import adam_rescale
    gen = torch.Generator().manual_seed(0)      # (not the global RNG: a calibration draws nothing a model would)
    p = _drawn(n, gen)
    g = _drawn(n, gen, dtype=dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
    out = torch.empty(n, dtype=g.dtype) if g.dtype != torch.float32 else None
    m, v = _drawn(n, gen, scale=1e-2), _drawn(n, gen, shift=0.5)
    return n / _timeit(lambda: adam_rescale(p, g, m, v, step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                            weight_decay=0.01, grad_scale=1.25, redo_scale=1.25, param_out=out),
                       torch.device("cpu"), at_least=at_least)


_MATMUL = {aten.mm.default: lambda a, b: 2 * a[0] * a[1] * b[1],
           aten.addmm.default: lambda c, a, b: 2 * a[0] * a[1] * b[1],
           aten.bmm.default: lambda a, b: 2 * a[0] * a[1] * a[2] * b[2],
           aten.baddbmm.default: lambda c, a, b: 2 * a[0] * a[1] * a[2] * b[2]}


def _shape(x):
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v) for v in val)
    return 0


def node_seconds(node: fx.Node, rates: Rates) -> float:
    """Estimated time of one graph node on the device: the longer of its FLOPs at the matmul rate (matmuls,
    attention, convolutions) and its bytes read and written at the memory bandwidth. A narrow matmul is
    bound by its bytes (a width-64 GPT's are, by the nominal H200 rates), and the planner's choice of what to
    recompute weighs an op's seconds against the bytes it saves: FLOPs alone made those matmuls look cheaper
    to recompute than a layer norm."""
    if node.op != "call_function":
        return 0.0
    target = op_of(node)
    if aliases_input(node) or getattr(target, "_schema", None) is None:
        return 0.0  # views, getitem and in-place bookkeeping move nothing new
    moved = _bytes(node.meta.get("val")) + sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return max(_flops(node, target) / rates.flops, moved / rates.mem_bw)


def _flops(node: fx.Node, target) -> float:
    if target in _MATMUL:
        shapes = [_shape(a) for a in node.args[: 3 if "add" in str(target) else 2]]
        if all(s is not None for s in shapes):
            return _MATMUL[target](*shapes)
    if target is aten.convolution.default:
        x, w, out = _shape(node.args[0]), _shape(node.args[1]), _shape(node)
        if x is not None and w is not None and out is not None and len(out) >= 3:
            # each output element: a dot product over in_channels / groups x kernel elements
            return 2 * math.prod(out) * math.prod(w[1:])
    name = getattr(target, "__name__", "")
    if "scaled_dot_product" in name or "attention" in name:
        q = _shape(node.args[0] if "backward" not in name else node.args[1])
        if q is not None and len(q) == 4:
            b, h, t, d = q
            fwd = 4 * b * h * t * t * d
            return (2.5 if "backward" in name else 1.0) * fwd
    return 0.0


if __name__ == "__main__":     # python -m pstar_fx.planning.costs DEVICE DTYPE KEY: one measurement, as JSON
    _dev, _dt, _key = sys.argv[1:4]
    print(json.dumps(asdict(_measure(torch.device(_dev), getattr(torch, _dt), _key))))
