"""The planner: Belady is optimal, predictions match measurements, recompute keeps results exact."""
import itertools
import random
import sys
import os

import math

import pytest
import torch

import pstar_fx
from pstar_fx.config import format_bytes
from pstar_fx.layout import packed_waste, search_chunk_size
from pstar_fx.models import GPT, Llama, gpt_config, llama_config
from pstar_fx.planning.schedule import belady, place_prefetches

sys.path.insert(0, os.path.dirname(__file__))
from test_engine import assert_matches_torch, batch  # noqa: E402


# ---- Belady against brute force -------------------------------------------------------------------------

def brute_force_fetches(reads, n_slots):
    """Fewest fetches over every eviction choice (exhaustive search with memo on (time, resident set))."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i, resident):
        if i == len(reads):
            return 0
        need = reads[i]
        missing = need - resident
        keep = resident & need
        others = sorted(resident - need)
        room = n_slots - len(keep) - len(missing)
        out = float("inf")
        for k in range(min(room, len(others)), -1, -1):
            if len(keep) + k + len(missing) > n_slots:
                continue
            for stay in itertools.combinations(others, k):
                out = min(out, len(missing) + best(i + 1, frozenset(keep | missing | set(stay))))
        return out

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_brute_force_optimum(seed):
    rng = random.Random(seed)
    n_chunks, n_slots, length = rng.randint(3, 6), rng.randint(1, 3), rng.randint(6, 14)
    reads = []
    for _ in range(length):
        k = rng.randint(0, min(2, n_slots))
        reads.append(frozenset(rng.sample(range(n_chunks), k)))
    intervals = belady([set(r) for r in reads], n_slots)
    assert len(intervals) == brute_force_fetches(reads, n_slots)
    # every read is covered by an interval of its chunk, and no more than n_slots overlap anywhere
    for i, r in enumerate(reads):
        for c in r:
            assert any(ch == c and s <= i <= e for ch, s, e in intervals)
        assert sum(s <= i <= e for _, s, e in intervals) <= n_slots


def test_prefetch_starts_early_enough_and_never_overfills_slots():
    reads = [{0}, set(), set(), {1}, set(), set(), {2}, set(), {0}]
    intervals = belady(reads, 2)
    sched = place_prefetches(intervals, 2, node_seconds=[1.0] * len(reads), copy_seconds={0: 1.5, 1: 1.5, 2: 1.5})
    prefetch_at = {c: i for i, ops in sched.before.items() for op, c in ops if op == "prefetch"}
    assert prefetch_at[1] <= 3 - 2 and prefetch_at[2] <= 6 - 2     # 2 nodes of 1 s hide a 1.5 s copy
    resident, peak = set(), 0
    for i in range(len(reads)):
        for op, c in sched.before.get(i, []):
            if op in ("prefetch", "fetch"):
                resident.add(c)
        assert reads[i] <= resident
        peak = max(peak, len(resident))
        for op, c in sched.after.get(i, []):
            resident.discard(c)
    assert peak <= 2


def test_the_copy_stream_runs_one_copy_at_a_time():
    """Three chunks read one node apart (1 s a node), each copy 1.5 s, every slot free from the start: one copy
    stream brings them in one after another (0-1.5, 1.5-3, 3-4.5 s), so the compute waits 0.5 s at each fetch,
    1.5 s in all (each copy hidden alone, as if they crossed side by side, would leave 0.5 s); each is queued as
    soon as its slot is free, in the order of the fetches."""
    reads = [set(), {1}, {2}, {3}, set()]
    sched = place_prefetches(belady(reads, 4), 4, node_seconds=[1.0] * len(reads),
                             copy_seconds={1: 1.5, 2: 1.5, 3: 1.5})
    assert sched.exposed_seconds == pytest.approx(1.5)
    prefetch_at = [(i, c) for i, ops in sorted(sched.before.items()) for op, c in ops if op == "prefetch"]
    assert prefetch_at == [(0, 1), (0, 2), (0, 3)]
    # a copy that lands in time costs nothing, and one queued behind it waits for it
    sched = place_prefetches(belady(reads, 4), 4, node_seconds=[1.0] * len(reads),
                             copy_seconds={1: 0.5, 2: 0.5, 3: 2.5})
    assert sched.exposed_seconds == pytest.approx(0.5)     # the third lands at 3.5 s, needed at 3


# ---- chunk size search ----------------------------------------------------------------------------------

def test_chunk_size_search_minimizes_layout_plus_one_chunk():
    """(chunks + 1) x size: the layout's memory plus one chunk of placement granularity and slot size."""
    numels = [50304 * 64] + [64 * 64 * 3, 64 * 3, 64 * 64, 64, 64 * 256, 256, 256 * 64, 64, 64, 64] * 6
    best = search_chunk_size(numels)
    lo = -(-max(numels) // 1024) * 1024
    hi = max(lo, min(4 * lo, sum(numels) // 8))
    assert lo <= best <= hi

    def cost(size):
        return (packed_waste(numels, size)[1] + 1) * size

    assert cost(best) <= 1.02 * min(cost(size) for size in range(lo, hi + 1, 1024))


def test_chunk_size_for_an_18b_gpt_is_about_one_layer():
    """Least padding alone chose 25 chunks of 733M elements for GPT3_18B (8 GiB of fp32 state per
    placement decision); the search takes at least twice as many, with little padding."""
    h = 4096
    layer = [h * 3 * h, 3 * h, h * h, h, h * 4 * h, 4 * h, 4 * h * h, h, h, h, h, h]
    numels = [50257 * h, 1024 * h] + layer * 90 + [h, h]
    best = search_chunk_size(numels)
    chunks = packed_waste(numels, best)[1]
    lo = -(-max(numels) // 1024) * 1024
    least_waste = min(range(lo, 4 * lo + 1, lo // 64 // 1024 * 1024), key=lambda s: packed_waste(numels, s)[0])
    assert chunks >= 2 * packed_waste(numels, least_waste)[1], (best, chunks, least_waste)
    assert packed_waste(numels, best)[0] / sum(numels) < 0.05


# ---- predicted peak against measured peak ---------------------------------------------------------------

CASES = [
    ("gpt", "fp32", "host", None),
    ("gpt", "bf16", "auto", 3),
    ("llama", "fp32", "auto", 2),
    ("llama", "bf16", "host", None),
]


@pytest.mark.parametrize("name,dtype,placement,device_chunks", CASES)
def test_measured_device_peak_matches_plan(name, dtype, placement, device_chunks):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny")) if name == "gpt" else Llama(llama_config("tiny"))
    inputs = batch(b=2, t=48)
    budget = None
    if device_chunks is not None:
        probe = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "dtype": dtype}, inputs)
        d = probe.device_breakdown
        budget = (d["activations"] + d["buffers"] + d["gradient slots"] + d["compute slots"] // 2
                  + device_chunks * 12 * (d["compute slots"] // probe.slots // (2 if dtype == "bf16" else 4)))
    engine = pstar_fx.compile(model, {"device": "cpu", "dtype": dtype, "placement": placement,
                                      "device_memory": budget}, inputs)
    for _ in range(2):
        engine.step(*inputs)
    measured = engine.memory_stats()["device_peak_bytes"]
    predicted = engine.plan.device_peak_bytes
    assert 0.85 <= measured / predicted <= 1.0, (measured, predicted)
    if budget is not None:
        assert measured <= budget


# ---- recompute --------------------------------------------------------------------------------------------

def test_recompute_when_activations_do_not_fit_keeps_fp32_exact():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = [batch(b=4, t=64, seed=s) for s in range(3)]
    probe = pstar_fx.plan(model, {"device": "cpu", "placement": "host"}, batches[0])
    d = probe.device_breakdown
    one_slot = d["compute slots"] // probe.slots
    budget = int(d["activations"] * 0.75) + d["gradient slots"] + 2 * one_slot
    engine = assert_matches_torch(model, batches, {"placement": "host", "device_memory": budget,
                                                   "optimizer": {"lr": 1e-3}})
    plan = engine.plan
    assert plan.recompute.startswith(tuple("123456789")), plan.recompute
    assert plan.activation_peak_bytes < d["activations"]
    assert engine.memory_stats()["device_peak_bytes"] <= budget


def test_runs_of_segments_keep_fewer_boundaries_and_stay_exact():
    """When recomputing every segment alone is not enough, runs of segments (inner boundaries recomputed
    too) are tried; the plan that needs them fits and trains exactly like torch."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=4))
    batches = [batch(b=4, t=16, seed=s) for s in range(3)]   # short: boundaries dominate
    smallest = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "device_memory": "1KiB"}, batches[0])
    assert not smallest.fits and "runs of" in smallest.recompute, smallest.summary()
    budget = smallest.device_peak_bytes       # the least any plan needs: fits only with runs
    engine = assert_matches_torch(model, batches, {"placement": "host", "device_memory": budget,
                                                   "optimizer": {"lr": 1e-3}})
    assert "runs of" in engine.plan.recompute, engine.plan.recompute
    assert engine.memory_stats()["device_peak_bytes"] <= budget


def test_too_small_budget_says_what_is_missing_and_what_was_tried():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    plan = pstar_fx.plan(model, {"device": "cpu", "device_memory": "200KiB"}, batch())
    assert not plan.fits
    assert "missing" in plan.why and "host" in plan.why and "recomputing every forward segment" in plan.why
    assert "DOES NOT FIT" in plan.summary()
    with pytest.raises(pstar_fx.BudgetError, match="missing.*recomputing"):
        pstar_fx.compile(model, {"device": "cpu", "device_memory": "200KiB"}, batch())


def test_a_full_host_is_named_as_the_tier_that_is_short():
    """A host_memory that holds only part of the state pushes the rest onto the device, which then overflows: the
    message says host_memory is what is short, with its numbers (issue 25: it said the device was missing bytes)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": "cpu", "chunk_size": 16384}
    free = pstar_fx.plan(model, dict(cfg, placement="host"), batch())
    state = free.host_breakdown["chunk state"]
    device_memory = free.device_peak_bytes + 2 * 12 * 16384        # the working set and two chunks' state
    plan = pstar_fx.plan(model, dict(cfg, device_memory=device_memory, host_memory=state // 3), batch())
    assert not plan.fits
    n_host = plan.placement.count("host")
    assert 0 < n_host < len(plan.placement) - 2
    assert plan.why.startswith(f"host_memory is too small: {format_bytes(state // 3)} holds the state of only "
                               f"{n_host} of {len(plan.placement)} chunks"), plan.why
    assert f"against device_memory {format_bytes(device_memory)}" in plan.why and "Raise host_memory by" in plan.why
    with pytest.raises(pstar_fx.BudgetError, match="host_memory is too small"):
        pstar_fx.compile(model, dict(cfg, device_memory=device_memory, host_memory=state // 3), batch())
    # the same device budget with room on the host fits: it was the host that was short
    assert pstar_fx.plan(model, dict(cfg, device_memory=device_memory), batch()).fits


# ---- planning big models without memory -----------------------------------------------------------------

def test_plan_10b_on_meta_for_an_h200_without_a_gpu():
    with torch.device("meta"):
        model = GPT(gpt_config("GPT3_10B"))
        inputs = (torch.zeros(1, 1024, dtype=torch.long), torch.zeros(1, 1024, dtype=torch.long))
    plan = pstar_fx.plan(model, {"device": "cuda", "device_memory": "141GB", "host_memory": "126GiB",
                                 "dtype": "bf16"}, inputs)
    assert plan.fits, plan.summary()
    state = plan.device_breakdown["chunk state"] + plan.host_breakdown["chunk state"]
    assert state >= 12 * 10.2e9                         # 12 B/param of fp32 state, all accounted


def test_16bit_shadows_ship_half_the_bytes_and_change_no_result():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = [batch(seed=s) for s in range(3)]
    common = {"device": "cpu", "dtype": "bf16", "placement": "host", "chunk_size": 16384, "optimizer": {"lr": 1e-3}}
    probe = pstar_fx.plan(model, common, batches[0])
    state = probe.host_breakdown["chunk state"]
    staging = 2 * 16384 * 2      # one host gradient buffer and the cast's staging; no room for shadows
    assert probe.host_breakdown["kept gradients"] > 0     # the roomy host keeps gradients; the tight one cannot
    runs = {}
    for name, host_memory in (("shadow", None), ("cast", state + staging)):
        engine = pstar_fx.compile(model, dict(common, host_memory=host_memory), batches[0])
        assert set(engine.plan.ship) == {name}, engine.plan.ship
        runs[name] = ([engine.step(*b).item() for b in batches], engine.state_dict(), engine.memory_stats())
    assert runs["shadow"][0] == runs["cast"][0]                               # bit-identical losses
    assert all(torch.equal(runs["shadow"][1][k], runs["cast"][1][k]) for k in runs["cast"][1])
    assert runs["shadow"][2]["h2d_bytes"] == runs["cast"][2]["h2d_bytes"]    # both cross 2 B/param ...
    assert runs["shadow"][2]["host_peak_bytes"] > runs["cast"][2]["host_peak_bytes"]  # ... shadows cost host


@pytest.mark.parametrize("cast_stream", ["0", "1"])
def test_fp32_masters_cross_in_staging_pieces_with_the_same_bits(monkeypatch, cast_stream):
    """A host chunk without a shadow crosses on CUDA as its fp32 master, cast on the device from a staging buffer
    of COPY_STAGING_ELEMS values, piece by piece: forced here on the CPU runtime (the cast then runs on the CPU
    tier) with pieces of 1000 values for 16384-value chunks, it trains the bits the shadows do, crosses 4 B/param,
    and the planned device peak (one piece of staging) is the measured one. PSTAR_FX_CAST_STREAM=1: the casts on a
    stream of their own, from two halves of the same buffer (pieces of 500), alike."""
    from pstar_fx.planning import memory, shipping
    monkeypatch.setenv("PSTAR_FX_CAST_STREAM", cast_stream)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = [batch(seed=s) for s in range(3)]
    common = {"device": "cpu", "dtype": "bf16", "placement": "host", "chunk_size": 16384, "optimizer": {"lr": 1e-3}}
    shadows = pstar_fx.compile(model, common, batches[0])
    want = ([shadows.step(*b).item() for b in batches], shadows.state_dict(), shadows.memory_stats())
    state = shadows.plan.host_breakdown["chunk state"]
    monkeypatch.setattr(shipping, "fallback_code", lambda itemsize, cuda: "fp32")
    monkeypatch.setattr(memory, "COPY_STAGING_ELEMS", 1000)
    engine = pstar_fx.compile(model, dict(common, host_memory=state + 2 * 16384 * 2), batches[0])
    assert set(engine.plan.ship) == {"fp32"}, engine.plan.ship
    assert engine.plan.device_breakdown["copy staging"] == 1000 * 4
    assert engine.rt.mover._staging.numel() == 1000
    assert (engine.rt.mover._cast_done is not None) == (cast_stream == "1")
    got = ([engine.step(*b).item() for b in batches], engine.state_dict(), engine.memory_stats())
    assert got[0] == want[0] and all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    assert got[2]["h2d_bytes"] == 2 * want[2]["h2d_bytes"]                  # 4 B/param against 2
    # the staging is planned as allocated: the plan's margin over the measured peak is the shadows' run's
    assert (engine.plan.device_peak_bytes - got[2]["device_peak_bytes"]
            == shadows.plan.device_peak_bytes - want[2]["device_peak_bytes"]), (engine.plan.device_breakdown,
                                                                                shadows.plan.device_breakdown)


@pytest.mark.parametrize("device,dtype", [("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")])
def test_kept_gradients_fit_at_the_plans_own_host_peak(device, dtype):
    """The check that the host holds the kept gradients counts what the plan then allocates: at exactly its own
    host peak a plan still keeps them (it used to hold back two chunks of gradient staging, which a plan with
    kept gradients never allocates). "cuda" is planned without a GPU, at nominal rates."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": device, "dtype": dtype, "placement": "host", "chunk_size": 16384, "grad_clip": 1.0}
    roomy = pstar_fx.plan(model, cfg, batch())
    assert roomy.transaction == "kept_grads" and roomy.host_breakdown["gradient staging"] == 0
    at = pstar_fx.plan(model, dict(cfg, host_memory=roomy.host_peak_bytes), batch())
    assert at.transaction == "kept_grads" and not at.why, at.summary()
    assert at.host_breakdown == roomy.host_breakdown
    # a byte less than the state and the kept gradients (16-bit shadows come after them: a chunk without one
    # crosses as fp32)
    short = pstar_fx.plan(model, dict(cfg, host_memory=roomy.host_peak_bytes - 1
                                      - roomy.host_breakdown["16-bit shadows"]), batch())
    assert short.transaction == "replay"


# ---- what a deferred step's updates cost ------------------------------------------------------------------

def test_after_verdict_exposure_follows_the_next_forwards_reads():
    """A deferred step's host Adam starts at the verdict and runs chunk after chunk; the next forward stalls where
    it reads a host chunk whose update (and the copy after it) has not finished, and starts only once the device
    chunks' updates are done (`device_s`), which delays its reads alike. Six nodes of 1 s: forward reads c0, c1, c2,
    backward c2, c1, c0."""
    from types import SimpleNamespace

    from pstar_fx.planning.host_adam import _after_verdict_exposed
    layout = SimpleNamespace(chunks=[SimpleNamespace(used_elems=10**9) for _ in range(3)])
    args = (["device", "host", "host"], layout, [1.0] * 6, [{0}, {1}, {2}, {2}, {1}, {0}], {2: 3, 1: 4, 0: 5})
    # 1 s of Adam a chunk: c1 done at 1 s (read at 1 s), c2 at 2 s (read at 2 s): late by the copy alone
    assert math.isclose(_after_verdict_exposed(*args, host_adam=1e9, copy_s={1: 0.1, 2: 0.1}, device_s=0.0), 0.1)
    assert math.isclose(_after_verdict_exposed(*args, host_adam=1e9, copy_s={1: 0.1, 2: 0.1}, device_s=0.5), 0.5)
    # 2 s a chunk: c2 done at 4 s, copied by 4.1 s, read at 0.5 + 2 s
    assert math.isclose(_after_verdict_exposed(*args, host_adam=0.5e9, copy_s={1: 0.1, 2: 0.1}, device_s=0.5), 2.1)


def test_a_deferred_plan_charges_the_host_adam_it_cannot_overlap_with_backward():
    """Planned for CUDA (without a GPU): every chunk on the host, the host Adam three times the step's compute.
    Speculating (kept_grads), the Adam overlaps backward; deferred, it starts at the verdict and overlaps only the
    next forward up to each chunk's first read: the estimate is larger, and grows by at least the Adam's seconds
    less the compute's. (The planner once timed a deferred step's Adam as if it ran inside backward: the two
    estimates were equal, 3.35 s for GPT3_18B with bf16 moments where the H200 ran 4.33 s.)"""
    from pstar_fx.planning.costs import Rates, assumed
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384, "grad_clip": 1.0}
    fast = pstar_fx.plan(model, dict(cfg, transaction="kept_grads"), batch())
    compute = fast.estimated_step_seconds
    updated = sum(p.numel() for p in model.parameters())      # no more than the chunks' elements the Adam reads
    rate = updated / (3 * compute)
    assert Rates.nominal(torch.device("cuda")).host_adam > rate
    with assumed(host_adam=rate):
        kept = pstar_fx.plan(model, dict(cfg, transaction="kept_grads"), batch())
        deferred = pstar_fx.plan(model, dict(cfg, transaction="deferred"), batch())
    assert kept.transaction == "kept_grads" and deferred.transaction == "deferred"
    assert deferred.estimated_step_seconds > kept.estimated_step_seconds + 1e-3 * compute
    assert deferred.estimated_step_seconds - fast.estimated_step_seconds >= updated / rate - compute - 1e-9
    assert "after the verdict" in deferred.summary()


def test_a_keeping_plan_keeps_one_gradient_slot_where_a_second_costs_its_kept_gradients_room(monkeypatch):
    """bf16 moments planned for CUDA (without a GPU): `deferred` keeps every gradient, and a keeping plan asks for a
    second gradient slot. Where that slot's device bytes cost a chunk (made so here: the placement gives one chunk
    fewer once the fixed bytes grow), the chunk's state moves to the host, where it may take the room the kept
    gradients needed: then the plan keeps one slot (it planned `deferred` with two and did not fit: 30.0B with int8
    moments, 1.84 GiB of host missing). With the host one chunk's state larger, two slots."""
    from pstar_fx.planning import planner
    torch.manual_seed(0)
    model = Llama(llama_config("tiny", n_layer=4))      # untied: one chunk's gradient at a time, one slot
    cfg = {"device": "cuda", "dtype": "bf16", "optimizer_state": "bf16", "chunk_size": 16384,
           "device_memory": "1GiB"}
    whole = pstar_fx.plan(model, cfg, batch())
    assert whole.grad_slots == 2 and whole.transaction == "deferred"
    n = len(whole.placement)
    fewest = []

    def place(sizes, config, *, fixed_bytes, **kw):     # half the chunks on the device, one fewer with more fixed
        fewest.append(fixed_bytes)
        return n // 2 if fixed_bytes == min(fewest) else n // 2 - 1
    monkeypatch.setattr(planner, "n_device_chunks", place)

    def plan(host: int):
        return pstar_fx.plan(model, {**cfg, "host_memory": host}, batch())
    lo = whole.host_breakdown["process overhead"]       # the least host budget that holds the kept gradients
    hi = lo + 8 * 2**20
    assert plan(hi).transaction == "deferred" and plan(lo).transaction == "two_pass"
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan(mid).transaction == "deferred" else (mid, hi)
    one = plan(hi)
    assert one.transaction == "deferred" and one.grad_slots == 1, one.summary()
    assert one.placement.count("device") == n // 2 and one.host_peak_bytes <= hi, one.summary()
    chunk_state = one.host_breakdown["chunk state"] // (n - n // 2)
    two = plan(hi + chunk_state)
    assert two.transaction == "deferred" and two.grad_slots == 2 and two.placement.count("device") == n // 2 - 1
    assert two.host_peak_bytes <= hi + chunk_state, two.summary()


def test_the_host_adam_shares_host_memory_with_the_copies(monkeypatch):
    """The host Adam and PCIe DMA share the host's memory (measured on the H200 host, bench/RESULTS.md sessions 8
    and 14): the Adam alone takes rate x its bytes per parameter, copies take theirs, the Adam gets the rest
    (never less than HOST_ADAM_MIN_SHARE). A CUDA plan with host chunks prices its host Adam at that share of its
    rate: the same plan with the share forced to 1 estimates a faster step."""
    import pstar_fx.planning.planner as planner
    from pstar_fx.planning.costs import HOST_ADAM_MIN_SHARE, assumed, host_adam_share
    assert host_adam_share(5.5e9, "fp32", 0.0) == 1.0
    assert math.isclose(host_adam_share(5.5e9, "fp32", 70.6e9), 1 - 70.6e9 / (5.5e9 * 28))
    assert math.isclose(host_adam_share(6.73e9, "bf16", 80.8e9), 1 - 80.8e9 / (6.73e9 * 20))
    assert host_adam_share(1e9, "int8", 1e12) == HOST_ADAM_MIN_SHARE
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384, "transaction": "kept_grads"}
    compute = pstar_fx.plan(model, cfg, batch()).estimated_step_seconds
    rate = sum(p.numel() for p in model.parameters()) / compute       # the Adam about as long as the compute
    with assumed(host_adam=rate):
        shared = pstar_fx.plan(model, cfg, batch())
        monkeypatch.setattr(planner, "host_adam_share", lambda *args: 1.0)
        alone = pstar_fx.plan(model, cfg, batch())
    assert shared.placement == alone.placement and shared.host_grad_buffers == alone.host_grad_buffers
    assert shared.estimated_step_seconds > alone.estimated_step_seconds


# ---- what a step costs when clipping triggers ---------------------------------------------------------------

# every field the planner reads, stated (planning for "cuda" starts from Rates.nominal, for "cpu" from this machine's
# calibration: `assumed` replaces both)
FIXED_RATES = dict(flops=3e11, mem_bw=1e11, h2d_bw=4e10, d2h_bw=2e10, host_adam=2e9, host_adam_bf16=2e9,
                   host_adam_int8=8.5e8, workspace_bytes=0, coll_bw=2e9, host_undo=1.9e9)


def test_triggered_step_arithmetic_per_transaction():
    """`_triggered_seconds` on a made-up step: eight nodes of 1 s, forward reads c0..c3, backward c3..c0 and
    updates each chunk after its read; c0, c1 on the device, c2, c3 on the host, 1e9 elements each. Every
    correction job costs 1 s: 28 B x 1e9 at 28 GB/s on the device, 1e9 / host_undo on the host, and a kept
    gradient coming back from the host 2 B x 1e9 at 2 GB/s."""
    from types import SimpleNamespace

    from pstar_fx.planning.costs import Rates
    from pstar_fx.planning.correction import (DEVICE_RESTORE_BYTES, _triggered_seconds, device_after_verdict_seconds,
                                              device_correction_bytes, host_correction_share)
    assert device_correction_bytes(2) == device_correction_bytes(4) == 28 and DEVICE_RESTORE_BYTES == 16
    layout = SimpleNamespace(chunks=[SimpleNamespace(used_elems=10**9) for _ in range(4)])
    rates = Rates("made-up", 1e12, 28e9, 2e9, 2e9, 1e9, host_undo=1e9)
    common = dict(cuda=True, placement=["device", "device", "host", "host"], layout=layout, node_secs=[1.0] * 8,
                  reads=[{0}, {1}, {2}, {3}, {3}, {2}, {1}, {0}], adam_at={3: 4, 2: 5, 1: 6, 0: 7}, rates=rates,
                  itemsize=2, copy_s={2: 0.1, 3: 0.1}, copies_exposed=0.25, adam_hidden=0.75, replay_host_exposed=0.5)

    def triggered(transaction, **kw):
        return _triggered_seconds(transaction, 10.0, **{**common, "kept_on_device": 2, **kw})

    # kept on the device: the device corrections (1 s each) run beside the next forward, which reads c0 at 0 s and
    # c1 at 1 s and so waits 1 s; with the kernels' share of the device's memory, they add 2 s; the worker, still
    # busy with the Adam the step hid (0.75 s), corrects c2 (done at 1.75 s) then c3 (2.75 s), in the forward's
    # order, copied by 1.85 and 2.85 s, read at 2 + 2 and 2 + 3 s: no stall
    assert math.isclose(triggered("kept_grads"), 10 + 2)
    # kept on the host, coming back at 1 GB/s (2 s a chunk): c0's kernel runs from 2 to 3 s, c1's from 4 to 5 s,
    # read at 0 and 1 s: the forward waits 4 s; with the first chunk's kept on the device, c0's runs from 0 to 1 s and
    # c1's from 2 to 3 s: 2 s
    slow_copies = dict(rates=Rates("made-up", 1e12, 28e9, 1e9, 2e9, 1e9, host_undo=1e9))
    assert math.isclose(triggered("kept_grads", kept_on_device=0, **slow_copies), 10 + 4)
    assert math.isclose(triggered("kept_grads", kept_on_device=1, **slow_copies), 10 + 2)
    # the forward does not wait for the device chunks it reads after their kernels have run: four kept gradients
    # coming back 0.5 s apart, kernels of 0.1 s, read 1 s apart from the verdict on: only the first is late (0.6 s),
    # where a forward that started after them all would have waited 2 s
    four = SimpleNamespace(chunks=[SimpleNamespace(used_elems=10**9) for _ in range(4)])
    assert math.isclose(device_after_verdict_seconds([], [0, 1, 2, 3], four, [1.0] * 4, [{0}, {1}, {2}, {3}], 2,
                                                     Rates("made-up", 1e12, 280e9, 4e9, 2e9, 1e9)), 0.6)
    # a host correction 4x slower: c2 done at 0.75 + 4 s, copied by 4.85, read at 2 + 2 s; c3 done at 8.75, copied by
    # 8.85, read at 2 + 3 s: 3.85 s late
    slow = dict(rates=Rates("made-up", 1e12, 28e9, 2e9, 2e9, 1e9, host_undo=0.25e9))
    assert math.isclose(triggered("kept_grads", **slow), 10 + 2 + 3.85)
    # the same with both device chunks' kept gradients coming back from the host (4 GB at 2 GB/s, c0's kernel done at
    # 2 s, c1's at 3 s: the forward waits 2 s) while the worker corrects: they pass through host memory beside it, 4 GB
    # over the corrections' 8 s, 0.5 GB/s of the 7 GB/s the correction moves alone (28 B x 0.25e9/s): it runs at
    # 13/14 of its rate, c3 done at 0.75 + 8 x 14/13 s, copied 0.1 s later, read at 2 + 3 s
    assert math.isclose(host_correction_share(0.25e9, 2 * 10**9, 4e9, slow["rates"]), 13 / 14)
    assert host_correction_share(0.25e9, 2 * 10**9, 0, slow["rates"]) == 1.0
    assert math.isclose(triggered("kept_grads", kept_on_device=0, **slow), 10 + 2 + (0.75 + 8 * 14 / 13 + 0.1 - 5))
    # replay: the device masters restored at 16 B per element (8/7 s), host restores overlapping the forward, then
    # one more forward+backward (8 s) with its exposed copies and host jobs (the pipeline at host_undo: 0.5 s)
    assert math.isclose(triggered("replay"), 10 + 0.75 + 16 / 28 * 2 + 8 + 0.25 + 0.5)
    assert triggered("replay", **slow) > triggered("replay")
    # the CPU runtime runs every correction inline, the "device" chunks' too
    assert math.isclose(triggered("kept_grads", cuda=False), 10 + 4)
    assert math.isclose(triggered("replay", cuda=False), 10 + 4 + 8 + 0.25 + 0.5)
    for transaction in ("deferred", "two_pass", "accumulate", "none"):
        assert triggered(transaction) == triggered(transaction, **slow) == 10.0


def _clip_plan(device, placement, transaction, grad_clip=1.0, **rates):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": device, "dtype": "bf16", "placement": placement, "chunk_size": 16384,
           "transaction": transaction}
    if grad_clip is not None:
        cfg["grad_clip"] = grad_clip
    from pstar_fx.planning.costs import assumed
    with assumed(**{**FIXED_RATES, **rates}):
        plan = pstar_fx.plan(model, cfg, batch())
    assert plan.transaction == transaction, plan.summary()
    return plan, sum(p.numel() for p in model.parameters())


def test_a_plans_triggered_estimate_is_the_documented_arithmetic():
    """kept_grads, planned for CUDA without a GPU: every chunk on the device, their gradients kept there, the
    correction is 28 B per element at mem_bw; every chunk on the host, a host correction far slower than the step
    is the step plus the elements at host_undo (and the next forward's few seconds' worth of reads); the CPU
    runtime runs every correction inline. deferred's (and two_pass's) triggered step is its step."""
    device, elems = _clip_plan("cuda", "device", "kept_grads")
    assert device.kept_on_device and device.placement.count("host") == 0
    assert math.isclose(device.estimated_triggered_step_seconds,
                        device.estimated_step_seconds + elems * 28 / FIXED_RATES["mem_bw"], rel_tol=1e-12)
    host, _ = _clip_plan("cuda", "host", "kept_grads", host_undo=1e3)
    assert host.placement.count("device") == 0
    assert math.isclose(host.estimated_triggered_step_seconds - host.estimated_step_seconds, elems / 1e3,
                        rel_tol=1e-4)
    cpu, _ = _clip_plan("cpu", "auto", "kept_grads")
    assert math.isclose(cpu.estimated_triggered_step_seconds,
                        cpu.estimated_step_seconds + elems / FIXED_RATES["host_undo"], rel_tol=1e-12)
    for transaction in ("deferred", "two_pass"):
        for device_type in ("cuda", "cpu"):
            plan, _ = _clip_plan(device_type, "host", transaction)
            assert plan.estimated_triggered_step_seconds == plan.estimated_step_seconds
    assert "when clipping triggers" in cpu.summary()
    assert "when clipping triggers" not in _clip_plan("cpu", "auto", "kept_grads", grad_clip=None)[0].summary()


def test_a_triggered_replay_costs_at_least_one_more_forward_and_backward():
    """A device-only plan without a transaction's extras estimates the forward+backward alone (nothing crosses,
    no host Adam): a triggered replay adds at least that to its own step."""
    fwd_bwd, _ = _clip_plan("cuda", "device", "none", grad_clip=None)
    for placement in ("device", "host"):
        replay, _ = _clip_plan("cuda", placement, "replay")
        assert (replay.estimated_triggered_step_seconds
                >= replay.estimated_step_seconds + fwd_bwd.estimated_step_seconds * (1 - 1e-9))


def test_a_slower_host_correction_moves_only_the_triggered_estimate():
    """host_undo prices the host corrections and nothing else: kept_grads' triggered step grows, its step and every
    other figure stay; a replay's restores run the same kernel (adam_undo, the master alone), so its triggered
    step grows too; deferred and two_pass plans are unchanged."""
    import re
    for transaction in ("kept_grads", "replay", "deferred", "two_pass"):
        fast, _ = _clip_plan("cuda", "host", transaction, host_undo=2e9)
        slow, _ = _clip_plan("cuda", "host", transaction, host_undo=2e8)
        strip = lambda text: re.sub(r" \([0-9.e+-]+ s when clipping triggers\)", "", text)  # noqa: E731
        assert strip(slow.summary()) == strip(fast.summary())
        assert slow.estimated_step_seconds == fast.estimated_step_seconds
        assert (slow.placement, slow.ship, slow.memory, slow.moves) == (fast.placement, fast.ship, fast.memory,
                                                                       fast.moves)
        if transaction in ("kept_grads", "replay"):
            assert slow.estimated_triggered_step_seconds > fast.estimated_triggered_step_seconds
        else:
            assert slow.summary() == fast.summary()
            assert slow.estimated_triggered_step_seconds == fast.estimated_triggered_step_seconds


def test_rates_without_the_host_correction_still_load():
    """A Rates record without host_undo (a cache file written before it: the cache's version changed, but a file
    may be copied) loads, and the fp32 host Adam's rate stands in for the correction's."""
    import dataclasses

    from pstar_fx.planning import costs
    old = {k: v for k, v in dataclasses.asdict(costs.Rates.nominal(torch.device("cuda"))).items() if k != "host_undo"}
    rates = costs.Rates(**old)
    assert rates.host_undo == 0.0 and rates.host_correction == rates.host_adam
    assert costs.Rates.nominal(torch.device("cuda")).host_correction == 0.96 * 4.0e9
    assert "rates-v9-" in costs._cache_path("x")


def test_the_matmul_rate_is_what_a_window_of_calls_sustains_not_one_fast_call():
    """costs._sustained times calls back to back in windows (the first not counted) and takes the best window's mean:
    a call that runs fast once in a while (an idle GPU's short boost) sets no rate. Here every tenth call sleeps 1 ms
    and the others 3 ms; the best single call would read 1 ms, a window of them reads about 2.8 ms (a 50 ms window
    holds about 16 calls, at most two of them fast: 2.6 ms at least). Sleeps are never shorter than asked, and longer
    ones only raise the mean, so the bound holds on any machine."""
    import time as clock

    from pstar_fx.planning import costs
    calls = []

    def call():
        calls.append(None)
        clock.sleep(1e-3 if len(calls) % 10 == 0 else 3e-3)
    seconds = costs._sustained(call, torch.device("cpu"), window=0.05, windows=3)
    assert seconds >= 2.4e-3, seconds
    assert len(calls) >= 2 + 4 * 4          # two calls alone, then four windows of several calls each


def test_rates_measured_by_a_child_started_ahead_are_taken_once(monkeypatch, caplog):
    """`start_calibration` starts the measuring child before the capture (on a GPU whose rates are not cached;
    here a CPU child stands for it); `_measure_in_child` takes that child's result, and a child that fails leaves
    the rates measured in this process, with a warning."""
    import subprocess

    from pstar_fx.planning import costs
    cpu = torch.device("cpu")
    monkeypatch.setattr(costs, "_CHILDREN", {})
    costs._CHILDREN["early"] = child = costs._child(cpu, torch.float32, "early")
    rates = costs._measure_in_child(cpu, torch.float32, "early")
    assert costs._CHILDREN == {} and child.returncode == 0
    assert rates.device == "early" and rates.flops > 0 and rates.host_adam > 0
    costs._CHILDREN["broken"] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True,
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    monkeypatch.setattr(costs, "_measure", lambda device, dtype, key: costs.Rates(key, 1.0, 1.0, 1.0, 1.0, 1.0))
    with caplog.at_level("WARNING", logger="pstar_fx"):
        assert costs._measure_in_child(cpu, torch.float32, "broken").device == "broken"
    assert "in a child process failed" in caplog.text and costs._CHILDREN == {}


def test_the_break_even_trigger_rate_is_where_speculating_and_deferring_cost_the_same():
    """At trigger rate r speculating costs speculated + r * (triggered - speculated), deferring `deferred`."""
    from pstar_fx.planning.transaction import defer_above
    r = defer_above(1.0, 3.0, 1.5)
    assert math.isclose(r, 0.25) and math.isclose(1.0 + r * (3.0 - 1.0), 1.5)
    assert defer_above(1.0, 3.0, 0.9) == 0.0        # deferring is never dearer: defer whenever anything may trigger
    assert defer_above(1.0, 3.0, 3.0) is None       # a correction costs no more than deferring: always speculate


def test_a_cuda_plan_that_may_defer_prices_both_and_says_when():
    """kept_grads chosen by "auto" with clipping, host chunks (their Adam after the verdict is exposed when
    deferred): the plan's break-even is the formula over its own estimates, explain() says it; pinned
    "kept_grads" or no clipping, the plan never defers; every chunk on the device, a correction costs what
    deferring costs and the plan always speculates. It says the run's timed steps choose once it has some.
    """
    from pstar_fx.planning.transaction import defer_above
    plan, _ = _clip_plan("cuda", "host", "kept_grads")   # pinned: no switch
    assert plan.defer_above is None and plan.estimate.deferred_step_seconds is None
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    from pstar_fx.planning.costs import assumed
    cfg = {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384, "grad_clip": 1.0}
    with assumed(**FIXED_RATES):
        auto = pstar_fx.plan(model, cfg, batch())
        device = pstar_fx.plan(model, dict(cfg, placement="device"), batch())
        unclipped = pstar_fx.plan(model, dict(cfg, grad_clip=None), batch())
    est = auto.estimate
    assert auto.transaction == "kept_grads"
    assert est.step_seconds < est.deferred_step_seconds < est.triggered_step_seconds
    assert auto.defer_above == defer_above(est.step_seconds, est.triggered_step_seconds, est.deferred_step_seconds)
    assert 0 < auto.defer_above < 1
    assert f"above {auto.defer_above:.0%}" in auto.transaction_cost
    assert "timed its steps, they choose" in auto.transaction_cost      # runtime/timed_switch.py
    assert "timed its steps" not in plan.transaction_cost
    assert "s deferred" in auto.summary()
    assert device.transaction == "kept_grads" and device.defer_above is None
    assert unclipped.defer_above is None


def test_as_many_device_chunks_keep_their_gradients_on_the_device_as_fit(monkeypatch):
    """A device budget with room beside the peak for one and a half kept gradients keeps one on the device (the
    first the next forward reads) and the others on the host; the memory model counts each where it is. (None
    counted in the memory backward frees: patched; the next test.)"""
    import pstar_fx.planning.planner as planner_module
    monkeypatch.setattr(planner_module, "n_kept_in_activations", lambda *a, **k: 0)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    cfg = {"device": "cpu", "placement": "device", "chunk_size": 16384, "grad_clip": 0.05,
           "transaction": "kept_grads"}
    roomy = pstar_fx.plan(model, cfg, batch())
    n = len(roomy.placement)
    chunk_bytes = 4 * 16384
    assert roomy.kept_on_device == n and roomy.device_breakdown["kept gradients"] == n * chunk_bytes
    budget = roomy.memory.device_peak_bytes - n * chunk_bytes + 3 * chunk_bytes // 2
    tight = pstar_fx.plan(model, dict(cfg, device_memory=budget), batch())
    assert tight.placement == roomy.placement and tight.kept_on_device == 1
    assert tight.device_breakdown["kept gradients"] == chunk_bytes
    assert tight.host_breakdown["kept gradients"] == (n - 1) * chunk_bytes
    assert f"1 of {n} device chunks' on the device" in tight.transaction_cost


def test_gradients_kept_in_what_backward_frees_are_counted_node_by_node():
    """transaction.n_kept_in_activations on a made-up step: live values after each of 8 nodes (their peak, 100, at
    node 2, the end of forward), 3 device chunks whose updates come at nodes 7, 6 and 4 (backward completes last the
    one the next forward reads first), 30 bytes a kept gradient, 50 bytes of the device peak besides the values.
    Each kept gradient counts from its update to the step's end, beside the values live then."""
    from pstar_fx.planning.transaction import kept_along, kept_in_activations_bytes, n_kept_in_activations
    acts = [10, 40, 100, 90, 80, 75, 70, 40]
    kept_at = [7, 6, 4]
    assert kept_along(8, kept_at[:2], 30) == [0, 0, 0, 0, 0, 0, 30, 60]
    # with k kept, live values + kept at nodes 4..7: k=1 -> 80 75 70 70; k=2 -> 80 75 100 100; k=3 -> 110 105 130 130
    assert [kept_in_activations_bytes(kept_at[:k], acts, 30, 100) for k in range(4)] == [0, 0, 0, 30]
    assert kept_in_activations_bytes(kept_at, acts, 30, 120) == 10     # over a peak the plan counts higher
    peak = 100 + 50
    assert n_kept_in_activations(kept_at, acts, 30, peak, 100, None) == 3      # no budget: all
    assert n_kept_in_activations(kept_at, acts, 30, peak, 100, 180) == 3      # 50 + 130
    assert n_kept_in_activations(kept_at, acts, 30, peak, 100, 179) == 2
    assert n_kept_in_activations(kept_at, acts, 30, peak, 100, 150) == 2      # 50 + 100: the peak unchanged
    assert n_kept_in_activations(kept_at, acts, 30, peak, 100, 149) == 0      # the step itself over the budget


def test_the_host_updates_a_correction_finds_queued_cost_it_nothing():
    """Backward updates c3, c2, c1, c0 in that order on the worker, 1 s each; with 2.5 s of that host Adam still
    running into the next forward at the verdict, c1 and c0 have not started (c2 has): those apply the verdict's
    coefficient themselves. Without a rate, every host chunk is corrected."""
    from types import SimpleNamespace
    from pstar_fx.planning.correction import not_started
    layout = SimpleNamespace(chunks=[SimpleNamespace(used_elems=10**9)] * 4)
    adam_at = {3: 10, 2: 11, 1: 12, 0: 13}
    assert not_started([0, 1, 2, 3], adam_at, layout, 2.5, 1e9) == {0, 1}
    assert not_started([0, 1, 2, 3], adam_at, layout, 0.5, 1e9) == set()
    assert not_started([0, 1, 2, 3], adam_at, layout, 9.0, 1e9) == {0, 1, 2, 3}
    assert not_started([0, 1, 2, 3], adam_at, layout, 2.5, 0.0) == set()


# ---- the largest models one H200 box trains (planned here at its recorded rates) ----------------------------------

def _recorded_fp32(results: str, layers: int) -> tuple:
    """bench/plan_at_rates.py and the H200 box's record (bench/results/`results`) of an h4096 GPT of `layers` layers
    with fp32 moments at 110 GiB of host, and the rates it was planned at."""
    import json
    from bench_modules import load
    box = load("plan_at_rates", "plan_at_rates")
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "results", results)
    with open(path) as f:
        record = next(r for r in map(json.loads, f)
                      if r.get("n_layer") == layers and r.get("optimizer_state") == "fp32")
    return box, record, {k: v for k, v in record["rates"].items() if k != "device"}


def _s14_fp32(layers: int) -> tuple:
    """bench/plan_at_rates.py and the rates the H200 box recorded for an h4096 GPT with fp32 moments at 110 GiB of
    host (session 14, bench/results)."""
    box, _, rates = _recorded_fp32("2026-12-03-h200-s14.jsonl", layers)
    return box, rates


def test_slot_waits_follow_the_copies_out_of_the_slots():
    """grad_slots.slot_waits on three chunks one after another (1 ms a node, 10 ms a gradient's copy out): with one
    slot each next chunk waits for the last one's copy; with two it takes the other slot, and waits only where the
    copies queue behind each other; a chunk updated on the device gives its slot back ready."""
    from pstar_fx.planning.grad_slots import slot_waits
    first, update = {2: 0, 1: 2, 0: 4}, {2: 1, 1: 3, 0: 5}          # backward: chunk 2's gradient, then 1's, 0's
    secs, copy = [1e-3] * 6, 10e-3
    assert slot_waits(first, update, {0, 1, 2}, secs, 1, copy) == pytest.approx(20e-3)
    assert slot_waits(first, update, {0, 1, 2}, secs, 2, copy) == pytest.approx(8e-3)
    assert slot_waits(first, update, {2}, secs, 1, copy) == pytest.approx(10e-3)
    assert slot_waits(first, update, set(), secs, 1, copy) == 0.0
    # a node of backward between each update and the next chunk's first gradient write hides a copy as long
    assert slot_waits({2: 0, 1: 3, 0: 6}, {2: 1, 1: 4, 0: 7}, {0, 1, 2}, [10e-3] * 8, 1, copy) == 0.0
    assert slot_waits({2: 0, 1: 3, 0: 6}, {2: 1, 1: 4, 0: 7}, {0, 1, 2}, [6e-3] * 8, 1, copy) == pytest.approx(8e-3)


def _made_plans(monkeypatch) -> list:
    """Every plan planner._make_plan makes from now on, in order: a search's tries, each with its host orders and
    gradient slots, for a test to read the ones made beside the plan chosen (`_made_before`)."""
    from pstar_fx.planning import planner
    make, made = planner._make_plan, []
    monkeypatch.setattr(planner, "_make_plan", lambda *a, **kw: made.append(make(*a, **kw)) or made[-1])
    return made


def _made_before(made: list, chosen, keep):
    """The last plan made before `chosen` (the last one of its host order, slots and estimate) for which keep(plan)
    holds: make_plan plans a try with the last chunks on the host first, then the other orders, then a second slot."""
    i = max(i for i, q in enumerate(made) if q.chunks.host_order == chosen.chunks.host_order
            and q.grad_slots == chosen.grad_slots and q.estimated_step_seconds == chosen.estimated_step_seconds)
    return next(q for q in reversed(made[:i]) if keep(q))


def test_backward_waits_for_gradients_copied_out_of_one_slot_and_a_second_hides_them(monkeypatch):
    """h4096 L90 with fp32 moments at 110 GiB of host (`replay`, 35 host chunks spread among the device chunks), at
    the rates the H200 box recorded (session 20, call 2), where the compute stream waited 0.37 s a step for copies
    and the plan's fetches explained 0.02 s of it: with one gradient slot every host chunk's gradient (0.54 GB)
    crosses to the host before the next chunk's can take the slot. The planner prices that wait (grad_slots.py),
    within 0.6-1.2x of the measured one (whether it is that wait is not established: bench/RESULTS.md, session 23),
    and takes a second slot, which hides it, for a lower estimate."""
    from pstar_fx.pipeline import recompute_search
    box, record, rates = _recorded_fp32("2026-12-05-h200-s20.jsonl", 90)
    monkeypatch.setattr(recompute_search._Search, "nestable", lambda self: None)     # the recorded run's recompute
    monkeypatch.setenv("PSTAR_FX_BLOCK_SPANS", "0")     # and its updates, each right after its chunk's last use
    made = _made_plans(monkeypatch)
    p = box.plan(90, "fp32", rates)
    assert p.fits and p.transaction == "replay" and p.grad_slots == 2, p.summary()
    # the chosen try's plan with one slot: made just before it, with the same order of host chunks
    one = _made_before(made, p, lambda q: q.grad_slots == 1 and q.chunks.host_order == p.chunks.host_order)
    measured = record["phases"]["compute_waits_for_copies"]
    assert 0.6 * measured <= one.estimate.grad_slot_waits_seconds <= 1.2 * measured, (one.estimate, measured)
    assert p.estimate.grad_slot_waits_seconds < 0.01 and p.estimated_step_seconds < one.estimated_step_seconds
    assert any("gradient slot" in n for n in one.notes), one.notes


def test_the_host_gradient_pool_is_sized_at_the_host_adams_rate_beside_the_copies(monkeypatch):
    """GPT3_18B with fp32 moments at 110 GiB of host (`replay`: host chunks' gradients wait in a pool of pinned
    buffers for the host Adam), planned at the rates the H200 box recorded for it (session 14, where the step
    waited 1.3 s for a buffer), the host chunks the last ones. The pool used to be sized at the host Adam's rate
    alone (7 buffers), while the estimate priced the Adam beside the step's copies (5.4 G params/s), where 7
    buffers leave 132 ms of it exposed: the pool is sized at that rate now, in room the shipping had for 16-bit
    shadows, when the estimate says so."""
    from pstar_fx.planning import placement, planner
    from pstar_fx.pipeline import recompute_search
    monkeypatch.setattr(placement, "HOST_ORDERS", ("last",))
    # the plan of that session: whole runs alone, one gradient slot whose copies out are not priced (pairs of runs
    # and a second slot, priced, now hold 6 more chunks on the device there, with 5 buffers enough)
    monkeypatch.setattr(recompute_search._Search, "nestable", lambda self: None)
    monkeypatch.setattr(planner, "slot_waits", lambda *a, **kw: 0.0)
    box, rates = _s14_fp32(90)
    p = box.plan(90, "fp32", rates)
    assert p.fits, p.why
    assert p.transaction == "replay" and p.chunks.host_order == "last"
    assert p.estimate.host_adam_rate < rates["host_adam"]            # priced beside the copies
    assert p.estimate.host_adam_exposed_seconds < 1e-3, p.estimate
    assert p.host_grad_buffers > 7
    assert p.host_peak_bytes <= 110 * 2**30 and p.device_peak_bytes <= box.BOX["device_memory"]


def test_the_largest_fp32_state_gpt_spreads_its_host_chunks_among_the_device_chunks(monkeypatch, cache_folder):
    """h4096 L99 with fp32 moments at 110 GiB of host: no host room for more than 2 gradient buffers, and with the
    last 20 of 43 chunks on the host their gradients reach the host Adam one after another, faster than it takes
    them (the H200 box: 1.77 s a step of the launching thread waiting for a buffer, 88 ms of host Adam per chunk).
    Spread every other one from the end, each follows a device chunk's backward: the plan, at the box's recorded
    rates, chooses that, and hides the host Adam the last-chunks plan leaves exposed. And it fits both budgets
    (trained on the box on 2026-12-01, 5.09 s a step), with at least 20 chunks' state on the host: a 4 GiB process
    reserve once left its plan one chunk short there, 19, and the device 1 GiB over. Activation bytes traced on the
    CPU are an estimate of CUDA's (the plan notes it)."""
    from pstar_fx.planning import planner
    box, rates = _s14_fp32(99)
    make, made = planner._make_plan, _made_plans(monkeypatch)
    spread = box.plan(99, "fp32", rates)
    # the last chunks on the host at the chosen try: made before the chosen plan, with no more gradient slots
    last = _made_before(made, spread, lambda q: q.chunks.host_order == "last" and q.grad_slots <= spread.grad_slots)
    # again: the plan cache's decision names the order, and the planner plans with it alone
    orders = []
    monkeypatch.setattr(planner, "_make_plan", lambda *a, **kw: orders.append(kw["host_order"]) or make(*a, **kw))
    again = box.plan(99, "fp32", rates)
    # (and the same order again with a second gradient slot: grad_slots.py)
    assert set(orders) == {"spread"} and again.estimated_step_seconds == spread.estimated_step_seconds, orders
    assert spread.fits and last.fits
    assert spread.chunks.host_order == "spread" and last.chunks.host_order == "last"
    assert last.estimate.host_adam_exposed_seconds > 0.1, last.estimate
    assert spread.estimate.host_adam_exposed_seconds < 1e-3, spread.estimate
    assert spread.estimated_step_seconds < last.estimated_step_seconds
    assert spread.placement.count("host") == last.placement.count("host") >= 20
    assert spread.host_peak_bytes <= 110 * 2**30 and spread.device_peak_bytes <= box.BOX["device_memory"]


def test_the_host_chunks_spread_every_other_one_from_the_end():
    """placement.device_order("spread"): the host takes the last chunk and every other one before it first, then
    the ones between; tiers() and ship_codes() read a placement of that order (an owner's k-th host chunk by its
    index among the host's)."""
    from pstar_fx.planning.placement import device_order, tiers
    from pstar_fx.planning.shipping import ship_codes
    order = device_order(7, "spread")
    assert sorted(order) == list(range(7)) and device_order(7, "last") == ()
    for n_device, host in ((6, [6]), (4, [2, 4, 6]), (3, [0, 2, 4, 6]), (2, [0, 2, 4, 5, 6]), (0, list(range(7)))):
        tier_of, placement, _ = tiers(7, n_device, 1, 0, order)
        assert [c for c in range(7) if tier_of[c] == "host"] == host, (n_device, tier_of)
    tier_of, _, _ = tiers(7, 4, 1, 0, order)
    ship_of, _ = ship_codes(tier_of, ["shadow", "fp32", "fp32"], world=1, rank=0, frozen=[False] * 7,
                            fallback="fp32")
    assert ship_of == ["-", "-", "shadow", "-", "fp32", "-", "fp32"]
    assert tiers(7, 4, 1, 0)[0] == ["device"] * 4 + ["host"] * 3          # the default: the last ones
