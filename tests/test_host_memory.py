"""Host buffers page-locked side by side (runtime/host_memory.py), without CUDA: a stand-in lock records what
cudaHostRegister would be asked to lock. Every buffer is filled and locked once, exactly its bytes, before the
batch ends; the engine trains the same bits with it, and what it locks is what the store charged."""
import gc
import logging
import threading

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.runtime import host_memory, store as store_mod
from test_engine import batch


class FakeLock:
    def __init__(self, fail_every: int = 0):
        self.locked: list[tuple[int, int, str]] = []       # (address, bytes, thread)
        self.unlocked: list[int] = []                       # addresses, as `register` unlocks them: when freed
        self.fail_every = fail_every
        self._mutex = threading.Lock()

    def __call__(self, t: torch.Tensor) -> int:
        with self._mutex:
            self.locked.append((t.data_ptr(), t.untyped_storage().nbytes(), threading.current_thread().name))
            if self.fail_every and len(self.locked) % self.fail_every == 0:
                return 1
            host_memory.when_freed(t, self.unlocked.append, t.data_ptr())
            return 0


def test_a_batch_fills_and_locks_every_buffer_on_its_workers_before_it_ends():
    lock = FakeLock()
    host = host_memory.HostBuffers(pin=True, threads=3, lock=lock)
    seen = []
    with host.batch(lambda done, total: seen.append((done, total))):
        assert host.queues
        bufs = [host.empty(1000 + i, torch.float32, fill=0) for i in range(20)]
        bufs.append(host.empty(77, torch.uint8, fill=127))
        bufs.append(host.empty(64, torch.bfloat16))                 # no fill: locked only
    assert not host.queues
    assert all(not b[:-1].any() for b in bufs[:20]) and bool((bufs[20] == 127).all())
    assert sorted((p, n) for p, n, _ in lock.locked) == sorted((b.data_ptr(), b.untyped_storage().nbytes())
                                                                for b in bufs)
    assert all(name.startswith("pstar_fx-pin") for _, _, name in lock.locked)
    assert seen[-1] == (len(bufs), len(bufs))
    outside = host.empty(10, torch.float32, fill=1.0)              # outside a batch: ready when handed out
    assert lock.locked[-1][0] == outside.data_ptr() and lock.locked[-1][2] == threading.current_thread().name


def test_a_buffer_that_cannot_be_locked_stays_usable_and_is_reported(caplog):
    host = host_memory.HostBuffers(pin=True, threads=2, lock=FakeLock(fail_every=3))
    with caplog.at_level(logging.WARNING, logger="pstar_fx"), host.batch():
        bufs = [host.empty(100, torch.float32, fill=2.0) for _ in range(7)]
    assert all(bool((b == 2.0).all()) for b in bufs)
    assert host.unlocked == [1, 1] and "2 host buffer(s) could not be page-locked" in caplog.text


def test_a_buffer_no_copy_touches_is_first_touched_by_the_workers_but_never_locked():
    lock = FakeLock()
    host = host_memory.HostBuffers(pin=True, threads=2, lock=lock)
    with host.batch():
        kept = host.empty(1000, torch.float32, fill=0, lock=False)
        odd = host.empty(500, torch.bfloat16, fill=1.5, lock=False)
        crossing = host.empty(800, torch.bfloat16)
    assert not kept.any() and bool((odd == 1.5).all()) and not crossing.any()   # (unfilled: zeroed as touched)
    assert [p for p, _, _ in lock.locked] == [crossing.data_ptr()]
    alone = host.empty(10, torch.float32, fill=2.0, lock=False)                # outside a batch: the same
    assert bool((alone == 2.0).all()) and len(lock.locked) == 1


def test_one_thread_or_no_pinning_makes_each_buffer_ready_when_handed_out():
    for pin, threads in ((True, 1), (False, 4)):
        lock = FakeLock()
        host = host_memory.HostBuffers(pin=pin, threads=threads, lock=lock)
        with host.batch():
            assert not host.queues
            b = host.empty(10, torch.float32, fill=3.0)
            assert bool((b == 3.0).all()) and len(lock.locked) == int(pin)


def test_pin_threads_reads_its_variable(monkeypatch):
    monkeypatch.setenv("PSTAR_FX_PIN_THREADS", "6")
    assert host_memory.pin_threads() == 6
    for bad in ("0", "many"):
        monkeypatch.setenv("PSTAR_FX_PIN_THREADS", bad)
        with pytest.raises(ValueError, match="PSTAR_FX_PIN_THREADS"):
            host_memory.pin_threads()


def _host_state_run(dtype: str = "fp32"):
    """A tiny GPT with its state on the host tier, compiled as the CPU compiles it (nothing page-locked): its
    config, inputs, model and engine, what a run with locked host buffers must equal bit for bit."""
    config = {"device": "cpu", "placement": "host", "chunk_size": 16384, "seed": 1, "optimizer": {"lr": 1e-3},
              "dtype": dtype}
    inputs = batch()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    return config, inputs, model, pstar_fx.compile(model, config, inputs)


def _lock_host_buffers(monkeypatch, lock, threads: int = 2) -> type:
    """The store's host buffers page-locked as on CUDA, `lock` standing in for cudaHostRegister, on `threads`
    workers; the class (its `made`: the last one made)."""
    class Locked(host_memory.HostBuffers):
        def __init__(self, pin, _threads, device):
            super().__init__(True, threads, lock)
            Locked.made = self

    monkeypatch.setattr(store_mod, "HostBuffers", Locked)
    return Locked


def _assert_same_bits(plain, other, inputs) -> None:
    """Two steps of each give the same losses, and their weights and moments are equal bit for bit."""
    for _ in range(2):
        assert torch.equal(plain.step(*inputs), other.step(*inputs))
    a, b = plain.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _locked_is_what_crosses(engine, lock: FakeLock) -> None:
    """Each host buffer locked once and exactly its bytes; the locked ones are every host buffer but those no copy
    reads (only the host Adam): the moments, and the master where its 16-bit shadow crosses instead. So the bytes
    locked are the host tier's charge less theirs."""
    from pstar_fx.runtime.store import master_crosses
    store = engine.rt.store
    locked = [p for p, _, _ in lock.locked]
    assert len(locked) == len(set(locked))
    host = [c for c in range(len(store.master)) if store.tier(c) == "host"]
    unlocked = [t for c in host for t in (store.exp_avg[c], store.exp_avg_sq[c]) if t is not None]
    unlocked += [store.master[c] for c in host if not master_crosses(engine.plan, c)]
    assert host and unlocked and not {t.data_ptr() for t in unlocked} & set(locked)
    assert {store.master[c].data_ptr() for c in host if master_crosses(engine.plan, c)} <= set(locked)
    assert {t.data_ptr() for t in store.shadow.values()} <= set(locked)
    assert sum(n for _, n, _ in lock.locked) == store.stats.host_bytes - sum(t.numel() * t.element_size()
                                                                              for t in unlocked)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_with_host_state_locked_side_by_side_trains_the_same_bits(monkeypatch, dtype):
    """fp32: each host chunk's master crosses (locked); bf16: its 16-bit shadow does, and the master stays unlocked."""
    config, inputs, model, plain = _host_state_run(dtype)
    lock = FakeLock()

    _lock_host_buffers(monkeypatch, lock, threads=4)
    locked = pstar_fx.compile(model, config, inputs)
    assert any(not name.startswith("MainThread") for _, _, name in lock.locked)
    _locked_is_what_crosses(locked, lock)
    _assert_same_bits(plain, locked, inputs)


def _held_until(event: threading.Event, lock: FakeLock):
    """A stand-in lock that holds each lock until `event` is set (10 s at most), then locks with `lock`; and the
    list of whether each wait saw the event (False: it timed out)."""
    waited: list[bool] = []

    def gated(t):
        waited.append(event.wait(timeout=10))
        return lock(t)
    return gated, waited


def test_host_state_is_page_locked_beside_the_region_builds_and_ready_before_the_init(monkeypatch):
    """compile() allocates the chunks, then builds the regions while the host buffers are page-locked, and waits
    for the masters' locks before the weights are written (fp32: every host master crosses): the locks here hold
    until the build has started (a build that came after them would leave them timing out), and the init finds
    every host master locked."""
    import pstar_fx.startup as startup_mod
    building = threading.Event()
    lock = FakeLock()
    gated, waited = _held_until(building, lock)
    _lock_host_buffers(monkeypatch, gated)
    real_build = startup_mod.build_regions_now

    def build(graph, device, phases, **kw):
        building.set()
        real_build(graph, device, phases, **kw)

    locked_at_init = []
    real_materialize = startup_mod.materialize

    def materialize(model, store, *args):
        locked_at_init.append({p for p, _, _ in lock.locked})
        return real_materialize(model, store, *args)

    monkeypatch.setattr(startup_mod, "build_regions_now", build)
    monkeypatch.setattr(startup_mod, "materialize", materialize)
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384, "seed": 1},
                              batch())
    assert waited and all(waited)                      # no lock finished before the build began
    # every host master locked when the init ran (other buffers may still be in the workers' hands)
    store = engine.rt.store
    masters = {store.master[c].data_ptr() for c in range(len(store.master)) if store.tier(c) == "host"}
    assert len(locked_at_init) == 1 and masters and masters <= locked_at_init[0]
    assert "page-lock masters" in engine.phases.seconds and "page-lock" in engine.phases.seconds
    _locked_is_what_crosses(engine, lock)


def test_the_init_waits_for_the_masters_it_writes_not_for_the_moments_zeroing(monkeypatch):
    """fp32 compute: each host chunk's master crosses, and is locked before the init writes it; its moments are
    only zeroed (never locked), and that zeroing goes on beside the init: here it is held until the init has begun
    (an init that waited for it would leave it timing out). The masters are asked for first, so the workers reach
    them before any moment. The same bits as a run that locks nothing."""
    config, inputs, model, plain = _host_state_run("fp32")
    initializing = threading.Event()
    lock = FakeLock()
    zeroed: list[bool] = []

    class Gated(host_memory.HostBuffers):
        def __init__(self, pin, _threads, device):
            super().__init__(True, 2, lock)

        def _ready(self, t, fill, pin):
            if not pin:                                 # a moment: zeroed once the init has begun
                zeroed.append(initializing.wait(timeout=10))
            return super()._ready(t, fill, pin)

    monkeypatch.setattr(store_mod, "HostBuffers", Gated)
    real_load = store_mod.ChunkStore.load_params
    at_init = []

    def load_params(store, tensors):
        at_init.append((store.pinning, len(lock.locked)))
        initializing.set()
        return real_load(store, tensors)

    monkeypatch.setattr(store_mod.ChunkStore, "load_params", load_params)
    locked = pstar_fx.compile(model, config, inputs)
    store = locked.rt.store
    host = [c for c in range(len(store.master)) if store.tier(c) == "host"]
    assert at_init == [(True, len(host))]              # the masters locked, the moments still being zeroed
    assert len(zeroed) == 2 * len(host) and all(zeroed)
    _locked_is_what_crosses(locked, lock)
    _assert_same_bits(plain, locked, inputs)


def test_masters_that_do_not_cross_are_initialized_while_the_host_state_is_page_locked(monkeypatch):
    """bf16 compute: a host chunk's 16-bit shadow crosses, its master does not (never locked). The init writes the
    masters while the rest is still being locked (the locks here hold until the init has begun: an init that
    waited for them would leave them timing out), and the shadows get their values once the locks are done: the
    same bits as a run that locks nothing."""
    import pstar_fx.startup as startup_mod
    config, inputs, model, plain = _host_state_run("bf16")
    initializing = threading.Event()
    lock = FakeLock()
    gated, waited = _held_until(initializing, lock)
    _lock_host_buffers(monkeypatch, gated)
    real_load = store_mod.ChunkStore.load_params
    pending_at_init = []

    def load_params(store, tensors):
        pending_at_init.append(store.pinning)
        initializing.set()
        return real_load(store, tensors)

    monkeypatch.setattr(store_mod.ChunkStore, "load_params", load_params)
    locked = pstar_fx.compile(model, config, inputs)
    assert pending_at_init == [True] and waited and all(waited)
    assert "16-bit copies" in locked.phases.seconds
    _locked_is_what_crosses(locked, lock)
    _assert_same_bits(plain, locked, inputs)


def test_a_failed_region_build_still_waits_for_the_page_locking(monkeypatch):
    import pstar_fx.startup as startup_mod
    lock = FakeLock()

    locked = _lock_host_buffers(monkeypatch, lock)

    def build(graph, device, phases, **kw):
        raise RuntimeError("the build failed")

    monkeypatch.setattr(startup_mod, "build_regions_now", build)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="the build failed"):
        pstar_fx.compile(GPT(gpt_config("tiny")), {"device": "cpu", "placement": "host", "chunk_size": 16384},
                         batch())
    assert not locked.made.queues and lock.locked        # its workers finished and were shut down


@pytest.mark.parametrize("cold", [True, False])
def test_weights_are_written_beside_this_processs_region_builds_with_the_bits_of_a_serial_init(monkeypatch, cold):
    """The initial weights are written on a thread of their own while this process builds (or loads) the regions,
    cold (workers building too) or warm. A build saves and restores the global RNG around each compile (Dynamo
    does) and may draw from it: done here all through the init, it changes no bit of the weights, and after
    compile() the global generator is where a serial init leaves it."""
    import threading

    import pstar_fx.startup as startup_mod
    events, started, ended = [], threading.Event(), threading.Event()

    class Workers:
        times = []                  # (what the workers said of their builds: nothing, here)

        def wait(self):
            return 1

        def stop(self):
            events.append("workers stopped")

    def start(graph, device, standby=None):
        return Workers() if cold else None

    def build(graph, device, phases, builders=True):
        assert started.wait(60)                     # the init is under way: meddle all through it
        while not ended.is_set():
            state = torch.get_rng_state()
            torch.randn(4096)
            torch.manual_seed(99)
            torch.set_rng_state(state)
        events.append(("built here", isinstance(builders, Workers) if cold else builders))

    real_materialize = startup_mod.materialize

    def materialize(*args):
        started.set()
        try:
            return real_materialize(*args)
        finally:
            ended.set()
            events.append("initialized")

    def compiled(meddle: bool):
        with torch.device("meta"):
            model = GPT(gpt_config("tiny"))
        torch.manual_seed(1234)                     # the caller's global state: compile() must not depend on it
        with monkeypatch.context() as m:
            if meddle:
                m.setattr(startup_mod, "start_region_builders", start)
                m.setattr(startup_mod, "build_regions_now", build)
                m.setattr(startup_mod, "materialize", materialize)
            engine = pstar_fx.compile(model, {"device": "cpu", "compute": "inductor", "placement": "host",
                                              "chunk_size": 16384}, batch())
        return {k: v.clone() for k, v in engine.state_dict().items()}, torch.get_rng_state()

    weights, after = compiled(meddle=True)
    assert sorted(map(str, events)) == sorted(map(str, ["initialized", ("built here", True if cold else None)]))
    plain, plain_after = compiled(meddle=False)
    assert weights.keys() == plain.keys() and all(torch.equal(weights[k], plain[k]) for k in plain)
    assert torch.equal(after, plain_after)
    # and those are a serial init's: the model's own init after torch.manual_seed(Config.seed)
    torch.manual_seed(pstar_fx.Config().seed)
    model = GPT(gpt_config("tiny"))
    serial = model.state_dict()
    assert all(torch.equal(plain[k], serial[k]) for k in plain if k in serial)
    assert torch.equal(plain_after, torch.get_rng_state())


@pytest.mark.parametrize("dtype,fill", [(torch.float32, 0), (torch.bfloat16, 0), (torch.uint8, 127),
                                        (torch.uint8, 0), (torch.float32, 1.5), (torch.int8, -1)])
def test_a_workers_first_values_are_torchs_fill(dtype, fill):
    """What a pin worker writes first (a memset where the value is a byte pattern) equals `fill_`, bit for bit."""
    got = torch.full((4099,), 7, dtype=dtype)
    host_memory._first_values(got, fill)
    want = torch.full((4099,), 7, dtype=dtype).fill_(fill)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_large_host_buffers_stay_out_of_forked_children():
    """`not_inherited` advises a buffer that is its own mapping (64 MiB and up) out of forked children (what
    `register` does before page-locking it), and leaves a small one (which may share pages with other objects)
    alone; a child forked after it runs and exits normally, and the parent's buffer keeps its values."""
    import os

    from pstar_fx.runtime.host_memory import OWN_MAPPING_BYTES, not_inherited
    big = torch.arange(OWN_MAPPING_BYTES // 4, dtype=torch.float32)
    small = torch.ones(1024)
    assert not_inherited(big) and not not_inherited(small)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if float(small.sum()) == 1024 else 1)     # the child reads what it has, never `big`
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    big[0] = 7.0
    assert big[0] == 7.0 and big[-1] == OWN_MAPPING_BYTES // 4 - 1


def test_a_reserve_locks_ahead_and_a_batch_takes_its_buffers():
    """HostReserve zeroes and locks buffers on its own workers before anyone asks; a batch's zero-filled (or
    unfilled) buffer of a reserved size is taken from it, waited for like the batch's own, and viewed as its
    dtype; other fills and sizes are the batch's; `close` frees what nobody took, each buffer locked once."""
    lock = FakeLock()
    reserve = host_memory.HostReserve(2, lock=lock)
    reserve.want({4000: 3, 64: 1})
    reserve.want({4000: 2})                                 # never fewer than asked before
    assert reserve.made == 4
    host = host_memory.HostBuffers(pin=True, threads=2, lock=lock)
    host.reserve = reserve
    with host.batch():
        taken = [host.empty(1000, torch.float32, fill=0), host.empty(2000, torch.bfloat16)]
        filled = host.empty(1000, torch.float32, fill=1.0)  # a fill other than 0: the batch's own buffer
        other = host.empty(500, torch.float32, fill=0)      # a size not reserved
    reserve.close()
    assert reserve.taken == 2
    assert taken[0].dtype == torch.float32 and taken[1].dtype == torch.bfloat16
    assert all(t.numel() * t.element_size() == 4000 and not t.any() for t in taken)
    assert bool((filled == 1.0).all()) and not other.any()
    locked = [p for p, _, _ in lock.locked]
    assert len(locked) == len(set(locked))                  # none twice
    assert {t.data_ptr() for t in taken + [filled, other]} <= set(locked)
    assert all(name.startswith(("pstar_fx-reserve", "pstar_fx-pin")) for _, _, name in lock.locked)
    # a taken buffer stays locked while its view lives (the reserve's byte tensor is gone), and no longer
    gc.collect()
    ptrs = {t.data_ptr() for t in taken}
    assert not ptrs & set(lock.unlocked)
    del taken
    gc.collect()
    assert ptrs <= set(lock.unlocked)


def test_memory_is_unlocked_when_its_storage_goes_not_the_tensor_it_was_locked_as(monkeypatch):
    """`register` unlocks when the last tensor of the memory goes, whatever its dtype or extent: the 70B LoRA's
    frozen host chunks, reserved as bytes and handed out as bf16 views, were unlocked while in use and crossed to
    the GPU from pageable memory at a sixth of the bus's rate."""
    calls = []

    class CudaRuntime:                          # cudaHostRegister / cudaHostUnregister, recorded
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", CudaRuntime)
    t = torch.zeros(4096, dtype=torch.uint8)
    ptr = t.data_ptr()
    assert host_memory.register(t) == 0
    view = t.view(torch.bfloat16)
    assert view._base is None                   # (a dtype view of another size keeps no reference to `t`)
    del t
    gc.collect()
    part = view[:16]
    del view
    gc.collect()
    assert calls == [("register", ptr)]
    del part
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]


def test_host_buffers_locked_ahead_of_the_plan_train_the_same_bits(monkeypatch):
    """compile() with a reserve (as on CUDA, with the search's tries planned ahead): the search tells it the host
    buffers the plan surely needs while it goes on, the store takes them, and the step trains the bits of a
    compile without one; what was locked is what the host tier was charged, each buffer once."""
    import pstar_fx.startup as startup_mod
    monkeypatch.setenv("PSTAR_FX_PLAN_WORKERS", "2")
    monkeypatch.setenv("PSTAR_FX_PLAN_CACHE", "0")
    config, inputs, model, plain = _host_state_run()
    lock = FakeLock()
    reserves = []

    _lock_host_buffers(monkeypatch, lock)

    def reserve(config):
        reserves.append(host_memory.HostReserve(2, lock=lock))
        return reserves[-1]

    monkeypatch.setattr(startup_mod, "host_reserve", reserve)
    ahead = pstar_fx.compile(model, config, inputs)
    (r,) = reserves
    n_host = ahead.plan.placement.count("host")
    assert n_host and r.made == n_host and r.taken == r.made     # each host chunk's master (the moments: unlocked)
    _locked_is_what_crosses(ahead, lock)
    _assert_same_bits(plain, ahead, inputs)


def test_huge_pages_are_asked_for_before_the_first_touch_unless_turned_off(monkeypatch):
    """By default (PSTAR_FX_HUGE_PAGES unset or 1) every host buffer a pinning store's batch, its reserve (locked or
    only zeroed) or a buffer made at once hands out is advised huge pages before its first values are written (its
    pages do not exist yet); with PSTAR_FX_HUGE_PAGES=0, or unpinned (the CPU tier), none is. A buffer so advised
    keeps its values (on the CPU box's kernel the advice itself is taken)."""
    from pstar_fx.runtime.host_memory import OWN_MAPPING_BYTES, huge_pages
    advised: list[tuple[int, bool]] = []                    # (address, touched already?)
    real_first = host_memory._first_values
    touched: set[int] = set()
    monkeypatch.setattr(host_memory, "_first_values",
                        lambda t, fill: (touched.add(t.data_ptr()), real_first(t, fill))[1])
    monkeypatch.setattr(host_memory, "huge_pages", lambda t: advised.append((t.data_ptr(), t.data_ptr() in touched)))

    def make(pin: bool) -> list[torch.Tensor]:
        touched.clear()                                     # (a freed buffer's address comes back)
        lock = FakeLock()
        reserve = host_memory.HostReserve(2, lock=lock) if pin else None   # (the engine makes one on CUDA only)
        if reserve is not None:
            reserve.want({4000: 1})
            reserve.want({800: 1}, lock=False)              # (zeroed ahead, never locked: a host chunk's moments)
        host = host_memory.HostBuffers(pin=pin, threads=2, lock=lock)
        host.reserve = reserve
        with host.batch():
            bufs = [host.empty(1000, torch.float32, fill=0), host.empty(300, torch.float32, fill=2.0),
                    host.empty(200, torch.float32, fill=0, lock=False)]
        if reserve is not None:
            reserve.close()
            assert reserve.taken == 2
        return bufs + [host.empty(10, torch.float32, fill=1.0)]

    monkeypatch.setenv("PSTAR_FX_HUGE_PAGES", "0")
    make(pin=True)
    assert advised == []
    monkeypatch.delenv("PSTAR_FX_HUGE_PAGES")
    make(pin=False)
    assert advised == []
    bufs = make(pin=True)
    assert sorted(p for p, _ in advised) == sorted(b.data_ptr() for b in bufs)
    assert not any(before for _, before in advised)
    assert not bufs[0].any() and bool((bufs[1] == 2.0).all()) and not bufs[2].any() and bool((bufs[3] == 1.0).all())
    advised.clear()
    monkeypatch.setenv("PSTAR_FX_HUGE_PAGES", "1")
    assert len(make(pin=True)) == len(advised) == 4
    monkeypatch.setenv("PSTAR_FX_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="PSTAR_FX_HUGE_PAGES"):
        host_memory.huge_pages_wanted()
    import os
    big = torch.empty(OWN_MAPPING_BYTES // 4)
    assert not huge_pages(torch.empty(16))                  # small: may share its pages, never advised
    # a kernel built with transparent huge pages (it has this file) takes the advice, whatever its mode
    assert huge_pages(big) == os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    big.fill_(3.0)
    assert bool((big == 3.0).all())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_unlocked_zero_state_is_an_untouched_mapping_and_trains_the_same_bits(monkeypatch, dtype):
    """An unlocked zero-filled host buffer that is written before it is read (a host chunk's master where its
    shadow crosses; every master on the CPU runtime) of LAZY_ZERO_BYTES or more is a fresh anonymous mapping that
    nothing touches before the init writes it: zero when read, and the engine trains the bits of one whose buffers
    were zeroed ahead (the threshold lowered so a tiny GPT's chunks take that path). The moments, read first by
    Adam, are zeroed ahead as before."""
    config, inputs, model, plain = _host_state_run(dtype)
    mapped_at = []
    real_mapping = host_memory.HostBuffers._zero_mapping
    monkeypatch.setattr(host_memory.HostBuffers, "_zero_mapping",
                        lambda self, n, dt: (lambda t: (mapped_at.append(t.data_ptr()), t)[1])(real_mapping(self, n, dt)))
    monkeypatch.setattr(host_memory, "LAZY_ZERO_BYTES", 1)
    fresh = host_memory.HostBuffers(pin=False).empty(1000, torch.float32, fill=0, written_first=True)
    assert mapped_at == [fresh.data_ptr()] and not fresh.any() and fresh.untyped_storage().nbytes() == 4000
    fresh[7] = 2.0                                          # writable, and its own
    assert float(fresh.sum()) == 2.0
    mapped = pstar_fx.compile(model, config, inputs)
    store = mapped.rt.store
    host = [c for c in range(len(store.master)) if store.tier(c) == "host"]
    moments = [store.exp_avg[c] for c in host] + [store.exp_avg_sq[c] for c in host]
    assert host and {store.master[c].data_ptr() for c in host} <= set(mapped_at)
    assert not {t.data_ptr() for t in moments} & set(mapped_at)
    _assert_same_bits(plain, mapped, inputs)


def test_a_second_compile_makes_the_host_buffers_of_the_first_before_its_capture(monkeypatch, cache_folder):
    """The host buffers a compile's store asked for are remembered (pipeline/reserve_cache.py); a second compile of
    the same model, inputs and config starts making all of them (locked and merely zeroed) before its capture, and
    the store takes every one. A remembered entry whose plan is not this compile's plan is a guess proved wrong:
    what it made is freed before the store allocates. Either way the step trains the bits of a plain compile."""
    import json

    import pstar_fx.engine as engine_mod
    import pstar_fx.startup as startup_mod
    from pstar_fx.pipeline import reserve_cache
    config, inputs, model, plain = _host_state_run()
    plain_too = pstar_fx.compile(model, config, inputs)     # (each comparison steps its plain engine)
    locks = [FakeLock()]                                    # each compile's own
    lock = lambda t: locks[-1](t)                           # noqa: E731
    reserves, made_at_capture = [], []
    _lock_host_buffers(monkeypatch, lock)

    reserve_lock = [lock]

    def reserve(config):
        reserves.append(host_memory.HostReserve(2, lock=reserve_lock[-1]))
        return reserves[-1]

    real_lowered = engine_mod.Lowered

    def lowered(*args, **kw):
        made_at_capture.append(reserves[-1].made)
        return real_lowered(*args, **kw)

    monkeypatch.setattr(startup_mod, "host_reserve", reserve)
    monkeypatch.setattr(engine_mod, "Lowered", lowered)
    first = pstar_fx.compile(model, config, inputs)
    (entry,) = cache_folder.glob("reserve-v*.json")
    asked = first.rt.store.host_asked
    n_host = first.plan.placement.count("host")
    unlocked = sum(v for (_, locked), v in asked.items() if not locked)
    assert unlocked == 2 * n_host and sum(asked.values()) - unlocked >= n_host   # moments; masters and more, locked
    total = sum(asked.values())

    locks.append(FakeLock())
    second = pstar_fx.compile(model, config, inputs)
    assert made_at_capture == [0, total]
    assert reserves[-1].taken == reserves[-1].made == total
    _locked_is_what_crosses(second, locks[-1])
    _assert_same_bits(plain, second, inputs)

    remembered = json.loads(entry.read_text())
    entry.write_text(json.dumps(dict(remembered, plan="another plan's")))
    locks.append(FakeLock())
    reserve_lock.append(FakeLock())                         # what the guess locks, apart
    third = pstar_fx.compile(model, config, inputs)
    assert made_at_capture[-1] == total and reserves[-1].taken == 0
    gc.collect()
    guessed = [p for p, _, _ in reserve_lock[-1].locked]
    assert guessed and set(guessed) <= set(reserve_lock[-1].unlocked)        # all freed again
    assert json.loads(entry.read_text())["plan"] == remembered["plan"]      # rewritten by this compile
    _locked_is_what_crosses(third, locks[-1])
    _assert_same_bits(plain_too, third, inputs)
    assert reserve_cache.load("not a key") is None
    monkeypatch.setenv("PSTAR_FX_RESERVE_CACHE", "0")      # off alone: nothing read
    assert reserve_cache.load(entry.name.split("-", 2)[2][:-5]) is None
    monkeypatch.setenv("PSTAR_FX_RESERVE_CACHE", "1")
    assert reserve_cache.load(entry.name.split("-", 2)[2][:-5]) is not None
