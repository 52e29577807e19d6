"""Plan.timeline() against the plan and the lowered graph it became; plot_memory and `explain --plot` write a PNG."""
import struct
import sys
import time

import pytest

import pstar_fx
from pstar_fx.cli import main
from pstar_fx.models import GPT, gpt_config
from pstar_fx.planning.plan import Memory, Moves, NodeProfile, Placement, Plan, Slots
from pstar_fx.planning.timeline import TIER_COPY_ON_DEVICE, TIER_DEVICE, TIER_HOST, TIER_MOVING, TIER_NAMES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_engine import batch, tight_budget  # noqa: E402

pytest.importorskip("matplotlib")
from pstar_fx.plot import plot_memory  # noqa: E402

MOVES = {"prefetch", "fetch", "release", "offload", "param"}   # what insert_chunk_ops adds to the planned graph


@pytest.fixture(scope="module")
def engine():
    """The tiny GPT with one chunk's state on the device and the rest moving, after one step. The timeline is
    of the planned step, which is engine.graph as insert_chunk_ops made it: the passes after it (grads_in_place
    here, compile_regions on CUDA) rewrite ops the plan already counted, so they are left out to compare."""
    model, inputs = GPT(gpt_config("tiny")), batch()
    budget, _ = tight_budget(model, inputs, device_chunks=1, chunk_size=16384)
    eng = pstar_fx.compile(model, pstar_fx.Config(device="cpu", device_memory=budget, chunk_size=16384,
                                                  disable_passes=("grads_in_place",)), example_inputs=inputs)
    eng.step(*inputs)
    return eng


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_timeline_is_the_plan_node_by_node(engine):
    plan, t = engine.plan, engine.plan.timeline()
    lowered = list(engine.graph.graph.nodes)
    n_params = len(engine.lowered.capture.params)
    # the planned graph is engine.graph without its chunk moves (and with the parameter placeholders
    # that insert_chunk_ops replaced by rt.param views)
    model_nodes = [n for n in lowered if not (n.op == "call_method" and n.target in MOVES)]
    assert t.nodes == len(model_nodes) + n_params == len(t.device_bytes) == len(t.host_bytes)
    names = {n.name for n in model_nodes}
    assert [name for name in t.node_names if name in names] == [n.name for n in model_nodes]

    assert max(t.device_bytes) == plan.device_peak_bytes
    assert min(t.device_bytes) >= t.device_fixed_bytes == plan.device_peak_bytes - plan.activation_peak_bytes
    assert set(t.host_bytes) == {plan.host_peak_bytes}
    assert t.device_budget_bytes == engine.config.device_memory

    # forward, then backward from the first node that reads the loss gradient
    assert 0 < t.backward_start < t.nodes
    by_name = {n.name: n for n in lowered}
    first_backward = by_name[t.node_names[t.backward_start]]
    assert "tangent" in [a.name for a in first_backward.all_input_nodes]
    assert all(t.backward_start < i for i, _ in t.update_at)          # every update runs inside backward

    # one mark per chunk op of the lowered graph, each right before the model node it was scheduled at
    ops = [n for n in lowered if n.op == "call_method"]
    for kind, events in (("prefetch", t.prefetch_at), ("fetch", t.fetch_at), ("release", t.release_at),
                         ("offload", t.offload_at), ("adam", t.update_at)):
        assert len(events) == sum(n.target == kind for n in ops), kind
    assert len(t.fetch_at) == plan.fetches > 0 and t.offload_at
    assert {c for _, c in t.offload_at} == {c for c, where in enumerate(plan.placement) if where == "host"}
    pending = []
    for node in lowered:
        if node.op == "call_method" and node.target == "fetch":
            pending.append(node.args[1])
        elif not (node.op == "call_method" and node.target in MOVES) and pending:
            i = t.node_names.index(node.name)
            assert sorted(pending) == sorted(c for j, c in t.fetch_at if j == i), node.name
            pending = []


def test_tiers_cover_every_chunk_at_every_node(engine):
    t = engine.plan.timeline()
    strip = t.tiers()
    assert len(strip) == len(t.placement) and all(len(row) == t.nodes for row in strip)
    assert all(set(row) <= set(range(len(TIER_NAMES))) for row in strip)
    for c, where in enumerate(t.placement):
        assert (set(strip[c]) == {TIER_DEVICE}) if where == "device" else (TIER_DEVICE not in strip[c])
    for i, c in t.fetch_at:                      # a fetched chunk is in a device slot or just arriving
        assert strip[c][i] in (TIER_COPY_ON_DEVICE, TIER_MOVING)
    for i, c in t.offload_at:
        assert strip[c][i] == TIER_MOVING
    host_rows = [strip[c] for c, where in enumerate(t.placement) if where == "host"]
    assert all(TIER_HOST in row for row in host_rows)          # and between its uses, only on the host

    small = t.tiers(columns=40, rows=3)          # downsampled: a cell keeps the most active state it covers
    assert len(small) == 3 and all(len(row) == 40 for row in small)
    assert any(TIER_MOVING in row for row in small) and TIER_DEVICE in small[0]


def test_plot_memory_writes_a_png_for_an_engine_and_for_a_plan(engine, tmp_path):
    path = engine.plot_memory(tmp_path / "engine.png")
    w, h = png_size(path)
    assert 800 <= w <= 4000 and 600 <= h <= 4000 and path.stat().st_size > 20_000
    model, inputs = GPT(gpt_config("tiny")), batch()
    plan = pstar_fx.plan(model, pstar_fx.Config(device="cpu", device_memory=engine.config.device_memory,
                                                chunk_size=16384), inputs)
    path = plot_memory(plan, tmp_path / "plan.svg", title="tiny, planned only")
    assert path.read_text().lstrip().startswith("<?xml") and "tiny, planned only" in path.read_text()


def test_missing_matplotlib_names_the_extra(engine, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install pstar_fx\[plot\]"):
        engine.plot_memory(tmp_path / "x.png")


def test_explain_plot_writes_the_file(tmp_path, capsys):
    out = tmp_path / "explain.png"
    assert main(["explain", "--model", "tiny", "--plot", str(out)]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    png_size(out)


def synthetic_plan(n_nodes=10_000, n_chunks=3_000, n_device=300) -> Plan:
    """A plan the size of a 20B GPT's: 10k nodes, 3000 chunks, each host chunk fetched in forward and backward."""
    names = [f"op{i}" for i in range(n_nodes)]
    half = n_nodes // 2
    before, after, fetches = {}, {}, 0
    host = range(n_device, n_chunks)
    for k, c in enumerate(host):
        for s in (k * half // len(host), n_nodes - 4 - k * half // len(host)):
            before.setdefault(names[max(0, s - 5)], []).append(("prefetch", c))
            before.setdefault(names[s], []).append(("fetch", c))
            after.setdefault(names[s + 2], []).append(("release", c))
            fetches += 1
    act = [min(i, n_nodes - i) * 2**20 for i in range(n_nodes)]
    return Plan(Placement(["device"] * n_device + ["host"] * len(host)), Slots(8, 2, 4), Moves(before, after, fetches),
                Memory(device_peak_bytes=10 * 2**30 + max(act), host_peak_bytes=100 * 2**30, device_breakdown={},
                       host_breakdown={}, activation_peak_bytes=max(act), optimizer_state="fp32",
                       state_bytes_per_param=12, budget_bytes=16 * 2**30),
                profile=NodeProfile(names, act, half, {c: n_nodes - 1 - c * half // n_chunks for c in range(n_chunks)},
                                    chunk_elems=2**26, param_elems=20 * 10**9))


def test_a_20b_sized_plan_draws_in_seconds(tmp_path):
    plan = synthetic_plan()
    start = time.perf_counter()
    t = plan.timeline()
    assert len(t.fetch_at) == plan.fetches and max(t.device_bytes) == plan.device_peak_bytes
    assert t.tiers(columns=1600, rows=256)[-1].count(TIER_MOVING) > 0
    path = plot_memory(plan, tmp_path / "big.png")
    assert time.perf_counter() - start < 60          # about 2 s on an idle core
    w, h = png_size(path)
    assert w >= 800 and h >= 600
