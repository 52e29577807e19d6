"""compile_regions: the compute between chunk nodes as compiled regions (Config.compute="inductor").

With torch.compile's "eager" backend (Dynamo alone, the regions' ops run as traced) a step must give the same
bits as the uncompiled one: that checks the pass moved only chunk nodes and cut the graph where it may. With
Inductor, an fp32 step is another evaluation of the same arithmetic and must match torch.optim.AdamW within
the rounding reach (test_engine.assert_matches_torch).
"""
import operator
import sys

import pytest
import torch

import pstar_fx
from pstar_fx.pipeline.lower import Lowered
from pstar_fx.models import GPT, gpt_config
import pstar_fx.passes.compile_regions  # noqa: F401  (the module, whose BACKEND the tests set)
from test_engine import assert_matches_torch, batch, tight_budget

CHUNK = 16384
regions_pass = sys.modules["pstar_fx.passes.compile_regions"]


@pytest.fixture
def dynamo_only(monkeypatch):
    monkeypatch.setattr(regions_pass, "BACKEND", "eager")


def _gpt(n_layer=2, seed=0):
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", n_layer=n_layer))


def _engine(model, inputs, compute, **cfg):
    return pstar_fx.compile(model, pstar_fx.Config(device="cpu", compute=compute, chunk_size=CHUNK, **cfg), inputs)


def _regions(engine):
    return [n for n in engine.graph.graph.nodes if isinstance(n.target, regions_pass.Region)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_regions_give_the_uncompiled_steps_bits(dynamo_only, dtype):
    """Chunks on both tiers (fetch, prefetch, release, offload and updates all in the graph), clipping on:
    the same losses and the same weights, bit for bit, as compute="eager"."""
    model = _gpt()
    batches = [batch(seed=s) for s in range(3)]
    budget, _ = tight_budget(model, batches[0], device_chunks=2, dtype=dtype, chunk_size=CHUNK)
    cfg = dict(device_memory=budget, dtype=dtype, grad_clip=0.5)
    ours, plain = _engine(model, batches[0], "inductor", **cfg), _engine(model, batches[0], "eager", **cfg)
    assert {"device", "host"} <= set(ours.plan.placement), ours.plan.placement
    assert _regions(ours), "no region was formed"
    for b in batches:
        assert torch.equal(ours.step(*b), plain.step(*b))
    a, b = ours.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_pairs_of_runs_in_regions_give_the_uncompiled_steps_bits(dynamo_only, monkeypatch):
    """An 8-layer GPT whose plan recomputes every run of segments with their pairs' inner boundaries remade too (a
    pair's first run copied twice into backward, recompute_search.Try.nested; chosen here by hand, as a budget
    would): the regions cut around those copies as well, and the steps give the uncompiled engine's bits."""
    from pstar_fx.pipeline import recompute_search
    model = _gpt(n_layer=8)
    batches = [batch(b=4, t=64, seed=s) for s in range(2)]
    with monkeypatch.context() as m:
        m.setattr(recompute_search._Search, "least_that_fits", lambda self: self.nestable())
        m.setattr(recompute_search._Search, "more_if_it_pays", lambda self, best: best)
        ours = _engine(model, batches[0], "inductor", placement="device")
    assert "pairs too" in ours.plan.recompute and _regions(ours), ours.plan.recompute
    plain = _engine(model, batches[0], "eager", placement="device")
    assert "pairs" not in plain.plan.recompute
    for b in batches:
        assert torch.equal(ours.step(*b), plain.step(*b))
    a, b = ours.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_chunk_nodes_keep_their_order_and_regions_hold_none(dynamo_only):
    model = _gpt(n_layer=4)
    inputs = batch()
    budget, _ = tight_budget(model, inputs, device_chunks=2, chunk_size=CHUNK)
    ours = _engine(model, inputs, "inductor", device_memory=budget)
    # the same plan (compiled compute plans by block: planning/blocks.py), its compute left op by op
    plain = _engine(model, inputs, "inductor", device_memory=budget, disable_passes=("compile_regions",))

    def moves(e):      # the chunk nodes that order slots, streams and updates, in graph order
        return [(n.target, n.args[1]) for n in e.graph.graph.nodes if n.op == "call_method"
                and n.target not in ("param", "grad")]
    assert moves(ours) == moves(plain)
    calls = _regions(ours)
    for call in calls:
        fn = call.target
        inner = [n for n in fn.graph_module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        assert inner and all(isinstance(n.target, torch._ops.OpOverload) for n in inner)
    # the four blocks' regions share compiled functions
    assert len({c.target for c in calls}) < len(calls)
    assert any("compute:" in note and "compiled by eager" in note for note in ours.plan.notes)
    assert "compile_regions" in ours.lowered.graphs_before


def test_regions_that_would_overrun_the_budget_stay_eager(dynamo_only):
    """A budget with no room above the uncompiled plan: every region that holds an input past its last use
    stays eager, the plan still fits, and the CPU tier (which enforces the budget node by node) runs it."""
    model = _gpt()
    inputs = batch()
    cfg = dict(device="cpu", chunk_size=CHUNK, placement="device")
    base = Lowered(model, pstar_fx.Config(**cfg), inputs).plan
    roomy = Lowered(model, pstar_fx.Config(**cfg, compute="inductor"), inputs).plan
    assert roomy.device_peak_bytes > base.device_peak_bytes     # here holding inputs costs (fp32, 97 KiB)
    exact = pstar_fx.Config(**cfg, device_memory=base.device_peak_bytes, compute="inductor")
    lowered = Lowered(model, exact, inputs)
    assert lowered.plan.fits and lowered.plan.device_peak_bytes == base.device_peak_bytes
    note = next(n for n in lowered.plan.notes if n.startswith("compute:"))
    assert "left eager" in note, note
    engine = pstar_fx.compile(model, exact, inputs)
    for s in range(2):
        engine.step(*batch(seed=s))
    assert engine.memory_stats()["device_peak_bytes"] <= base.device_peak_bytes


def test_regions_are_built_at_compile_and_never_again(dynamo_only, monkeypatch):
    """compile() builds every region on stand-in inputs laid out like the step's (chunk views at their offsets,
    activations with their strides): the steps then reuse those builds, nothing is compiled or recompiled, also
    when one tensor is passed as two inputs (labels=input_ids; Dynamo guards against repeated inputs)."""
    from torch._dynamo.utils import counters
    model = _gpt()
    inputs = batch()
    budget, _ = tight_budget(model, inputs, device_chunks=2, chunk_size=CHUNK)
    engine = _engine(model, inputs, "inductor", device_memory=budget)
    assert "build regions" in engine.phases.seconds
    # a recompile is one graph more (counted, not raised by error_on_recompile: in one full-suite run Dynamo's
    # config had no such attribute by the time a test here patched it)
    graphs = counters["stats"]["unique_graphs"]
    for s in range(2):
        engine.step(*batch(seed=s))
    assert counters["stats"]["unique_graphs"] == graphs
    # every chunk on the device tier, planned op by op (by block, the embedding's region and the loss's are two):
    # the first region reads both inputs (the ids and the targets)
    monkeypatch.setenv("PSTAR_FX_BLOCK_SPANS", "0")
    engine = _engine(model, inputs, "inductor")
    placeholders = [n for n in engine.graph.graph.nodes if n.op == "placeholder" and n.name.startswith("input_")]
    assert len(placeholders) == 2
    assert any(all(p in r.args for p in placeholders) for r in _regions(engine))
    graphs = counters["stats"]["unique_graphs"]
    ids = batch(seed=2)[0]
    engine.step(ids, ids)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.library.custom_op("pstar_fx_test::column_major", mutates_args=())
def column_major(x: torch.Tensor) -> torch.Tensor:
    """x's values laid out column-major, where its fake says row-major: a library kernel whose result is not
    what its fake value says (as flash attention's RNG seed is a CPU tensor, its fake a CUDA one)."""
    return x.t().contiguous().t()


@column_major.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


column_major.register_autograd(lambda ctx, grad: grad)


class _Unfaithful(torch.nn.Module):
    """Two Linears (two chunks) and a value made by `column_major` in forward, read again in backward (h * h)."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x, y):
        h = column_major(torch.relu(self.a(x)) * 2)
        return ((self.b(h) + h * h - y) ** 2).mean()


def test_a_region_input_another_region_returns_is_built_as_it_was_returned(dynamo_only):
    """build_regions lays out a region's input that an earlier region returns as that region's build returned it
    (here column-major), not as its fake says (row-major): the step recompiles nothing."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = _Unfaithful()
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", compute="inductor", placement="host",
                                                     chunk_size=4224), (x, y))
    assert len(engine.plan.placement) == 2 and len(_regions(engine)) >= 2
    graphs = counters["stats"]["unique_graphs"]     # a recompile is one more
    for _ in range(2):
        engine.step(x, y)
    assert counters["stats"]["unique_graphs"] == graphs


def test_inductor_regions_match_adamw():
    """Real Inductor kernels (C++ on the CPU): fp32 losses and weights within torch's rounding reach.

    With eps 1e-3, not 1e-8: Inductor sums in another order than ATen, and at eps 1e-8 Adam normalizes the
    last-bit differences of gradients that are tiny against their summands into lr-sized steps (the tied
    embedding's rare tokens, 10x torch's reach after 3 steps). A larger eps keeps each update linear in its
    gradient there, so what is compared is the regions' arithmetic (measured: within 1.5x of torch's reach)."""
    model = _gpt(n_layer=1)
    batches = [batch(seed=s) for s in range(3)]
    engine = assert_matches_torch(model, batches, dict(compute="inductor", chunk_size=CHUNK, placement="host",
                                                       optimizer={"type": "adamw", "eps": 1e-3}))
    assert _regions(engine)
    assert "region_0" in engine.graph.code


@pytest.mark.parametrize("kind,dropout", [("gpt2", True), ("llama", False)])
def test_hugging_face_models_through_regions_give_the_same_bits(dynamo_only, kind, dropout):
    """Unmodified Hugging Face models (GPT-2 with dropout: its seeded random ops end regions; Llama's rotary
    embedding, RMSNorm and SiLU gating inside them), most state on the host: the uncompiled step's bits."""
    import copy
    pytest.importorskip("transformers")
    from test_hf import OPT, batches, hf_model
    model = hf_model(kind, dropout=dropout)
    data = batches(kind, 3)
    runs = []
    for compute in ("eager", "inductor"):
        engine = pstar_fx.compile(copy.deepcopy(model), pstar_fx.Config(device="cpu", optimizer=OPT, chunk_size=CHUNK,
                                                                         compute=compute, placement="host"), data[0])
        runs.append(([engine.step(**d) for d in data], engine.state_dict(), engine))
    (a, sa, _), (b, sb, ours) = runs
    assert _regions(ours)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_region_key_is_equal_exactly_for_the_same_ops_constants_and_layouts():
    """Regions share a compiled function by key (`_key`): the same ops with the same constants on inputs laid out
    alike give one key; another constant, overload, argument order or input layout gives another."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def key(fn, *shapes, contiguous=True):
        xs = [torch.zeros(s) if contiguous else torch.zeros(s[::-1]).t() for s in shapes]
        g = make_fx(fn)(*xs).graph
        inputs = list(g.find_nodes(op="placeholder"))
        ops = [n for n in g.nodes if n.op == "call_function"]
        return regions_pass._key(ops, inputs, [ops[-1]])

    base = key(lambda x, y: torch.relu(x * 0.5 + y), (4, 8), (4, 8))
    assert base == key(lambda a, b: torch.relu(a * 0.5 + b), (4, 8), (4, 8))
    others = [key(lambda x, y: torch.relu(x * 0.25 + y), (4, 8), (4, 8)),       # a constant
              key(lambda x, y: torch.relu(x * 0.5 - y), (4, 8), (4, 8)),        # an op
              key(lambda x, y: torch.relu(y * 0.5 + x), (4, 8), (4, 8)),        # which input is scaled
              key(lambda x, y: torch.relu(x * 0.5 + y), (8, 8), (8, 8)),        # a shape
              key(lambda x, y: torch.relu(x * 0.5 + y), (4, 8), (4, 8), contiguous=False),   # strides
              key(lambda x, y: torch.relu(x * 0.5 + y.sum(0)), (4, 8), (4, 8)),              # an overload's args
              key(lambda x, y: torch.relu(x * 0.5 + y.sum(1, keepdim=True)), (4, 8), (4, 8))]
    assert len({base, *others}) == 1 + len(others)


def test_equal_runs_return_what_any_of_them_needs_where_there_is_room():
    """Two runs of the same ops on inputs laid out alike, the first's middle value read after it and the second's not
    (the last block's forward): both return it, so they share one function, unless the second run's spare memory
    has no room for the value's bytes; runs of other ops are left alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, y):
        a = torch.exp(x)
        b = a * 2
        c = torch.exp(y)            # the second run: the same ops
        d = c * 2
        return a + b, d             # a is read after its run, c is not

    g = make_fx(step)(torch.zeros(4, 8), torch.zeros(4, 8)).graph
    ops = [n for n in g.nodes if n.op == "call_function"]
    first, second, other = ops[0:2], ops[2:4], ops[4:5]     # other: a + b, other ops
    io = {id(r): regions_pass._region_io(r) for r in (first, second, other)}
    structure = {id(r): regions_pass._structure(r, io[id(r)][0]) for r in (first, second, other)}

    def shared(runs, spare):
        return regions_pass._shared_outputs(runs, dict(zip(map(id, runs), spare)), structure, io)

    returned = shared([first, second], [None, None])
    assert returned == {id(second): [0, 1]}         # the first returns both already
    value_bytes = 4 * 8 * 4
    assert shared([first, second], [0, value_bytes]) == returned
    assert shared([first, second], [0, value_bytes - 1]) == {}
    assert shared([first, other], [None, None]) == {}       # no group of its own to share with


def test_regions_fed_one_tensor_twice_by_inductor_are_built_for_it(monkeypatch):
    """Inductor returns one tensor for a region's outputs that alias (HF Llama's RMSNorm: its rsqrt and the detach
    saved for backward), so the next region receives it as two inputs. build_regions hands that region one
    stand-in twice, as the step will (Dynamo guards on repeated inputs): the steps then compile nothing (before,
    5 regions of a 2-layer Llama compiled again at the first step: ~20 s at Llama-3-8B's shape on the H200)."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    from test_hf import batches, hf_model
    model = hf_model("llama", dropout=False)
    data = batches("llama", 2)
    engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", compute="inductor", chunk_size=CHUNK), data[0])
    twice = []
    call = regions_pass.Region.__call__

    def recording(region, *args):
        ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
        twice.extend([region.__name__] if len(set(ids)) < len(ids) else [])
        return call(region, *args)

    monkeypatch.setattr(regions_pass.Region, "__call__", recording)
    graphs = counters["stats"]["unique_graphs"]     # a recompile is one more
    for d in data:
        engine.step(**d)
    assert twice, "no region received one tensor twice: the case is not exercised"
    assert counters["stats"]["unique_graphs"] == graphs


def _breaks_the_graph(x):
    torch._dynamo.graph_break()
    return x * 2


def test_a_region_dynamo_cannot_compile_runs_op_by_op(caplog, monkeypatch):
    """Dynamo refusing a region (torch 2.11 did, "Attempt to trace generator", for some of a 70B LoRA's regions)
    leaves that region to run its ops as they are, with the same values, and says so once; it is not tried again."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(_breaks_the_graph, (x,))
    g.output((g.call_function(torch.ops.aten.relu.default, (y,)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    # a pickled copy is traced again by torch.fx on loading, which would inline the graph break away
    monkeypatch.setattr(regions_pass, "_as_a_worker_has_it", lambda m: m)
    region = regions_pass.Region(gm, "region_t", "eager", [None])
    a = torch.randn(5) - 0.5
    with caplog.at_level("WARNING", logger="pstar_fx"):
        out = region(a)
        again = region(a)
    assert torch.equal(out[0], torch.relu(a * 2)) and torch.equal(again[0], out[0])
    assert region.eager_because and "graph" in region.eager_because.lower(), region.eager_because
    said = [r.getMessage() for r in caplog.records if "region_t" in r.getMessage()]
    assert len(said) == 1 and "op by op" in said[0], said


def test_a_region_needing_more_memory_compiled_than_the_plan_leaves_runs_op_by_op(dynamo_only, monkeypatch, caplog):
    """Each region knows the device memory the plan leaves at its fullest call; one whose compiled code holds more
    than its ops one by one, beyond that (measured at the build on CUDA: here the measurement is stood in for),
    runs op by op, said once, and the step keeps the uncompiled step's bits."""
    model = _gpt()
    batches = [batch(seed=s) for s in range(2)]
    budget, _ = tight_budget(model, batches[0], device_chunks=2, chunk_size=CHUNK)
    greedy = []

    def extra(region, examples, device):          # the first region built needs 1 GiB more compiled
        greedy.extend([] if greedy else [region])
        return 2**30 if region is greedy[0] else 0

    monkeypatch.setattr(regions_pass, "_extra_bytes", extra)
    with caplog.at_level("WARNING", logger="pstar_fx"):
        ours = _engine(model, batches[0], "inductor", device_memory=budget, grad_clip=0.5)
    plain = _engine(model, batches[0], "eager", device_memory=budget, grad_clip=0.5)
    regions = ours.graph.meta["regions"]
    assert all(r.spare_bytes is not None and 0 <= r.spare_bytes < budget for r in regions), \
        [r.spare_bytes for r in regions]
    assert [r for r in regions if r.eager_because] == greedy, [r.eager_because for r in regions]
    assert "1.00 GiB more device memory" in greedy[0].eager_because, greedy[0].eager_because
    said = [r.getMessage() for r in caplog.records if "op by op" in r.getMessage()]
    assert len(said) == 1 and greedy[0].__name__ in said[0], said
    assert f"region {greedy[0].__name__} (" in ours.explain() and "runs op by op" in ours.explain()
    for b in batches:
        assert torch.equal(ours.step(*b), plain.step(*b))


@pytest.mark.gpu
def test_the_build_measures_what_a_compiled_region_holds_beyond_its_ops_on_cuda():
    """On CUDA, `_extra_bytes` runs the built region and its ops one by one on the build's inputs: a region whose
    compiled code holds no more than its ops (an elementwise chain Inductor fuses into one kernel) measures 0, and
    its outputs are the same values either way."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    y = g.call_function(torch.ops.aten.relu.default, (y,))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (y, 1.0)),))
    region = regions_pass.Region(torch.fx.GraphModule(torch.nn.Module(), g), "region_g", "inductor", [None])
    device = torch.device("cuda")
    x = torch.randn(1 << 20, device=device)
    assert torch.equal(region(x)[0], torch.relu(x * 2) + 1)
    assert regions_pass._extra_bytes(region, [x], device) == 0


@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "wrapped-by-inductor"])
def test_a_region_out_of_memory_at_its_build_runs_op_by_op(dynamo_only, monkeypatch, wrapped):
    """A region whose compiled code runs out of device memory at its build (no activation is held yet: the step's
    call would too) runs op by op; the step keeps the uncompiled step's bits. So does one whose build raised the
    error wrapped (Inductor's autotuning raises an InductorError caused by it: an H100 compile failed so)."""
    model = _gpt()
    batches = [batch(seed=s) for s in range(2)]
    first = []
    compiled = regions_pass.Region.compiled

    def short(region, *args):
        first.extend([] if first else [region])
        if region is first[0]:
            if wrapped:
                try:
                    raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
                except torch.OutOfMemoryError as e:
                    raise RuntimeError("Failed to run autotuning code block (stand-in)") from e
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return compiled(region, *args)

    monkeypatch.setattr(regions_pass.Region, "compiled", short)
    ours = _engine(model, batches[0], "inductor")
    plain = _engine(model, batches[0], "eager")
    assert [r for r in ours.graph.meta["regions"] if r.eager_because] == first
    assert "out of device memory at its build" in first[0].eager_because
    for b in batches:
        assert torch.equal(ours.step(*b), plain.step(*b))


def test_an_artifact_failing_at_its_first_call_gives_way_to_dynamo_and_a_later_failure_is_raised(caplog):
    """A region's standalone Inductor artifact (PSTAR_FX_REGION_ARTIFACTS=1) that fails at its first call (torch
    2.11's alignment wrapper raised IndexError on the H200) leaves the region to Dynamo's build, said with the
    error; once it has run, a failure inside it is the step's and is raised."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.relu.default, (g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)),)),))
    region = regions_pass.Region(torch.fx.GraphModule(torch.nn.Module(), g), "region_a", "eager", [None])
    a = torch.randn(5)

    def broken(*args):
        raise IndexError("list index out of range")

    region._artifact = broken
    with caplog.at_level("WARNING", logger="pstar_fx"):
        out = region(a)
    assert torch.equal(out[0], torch.relu(a * 2)) and region._artifact is None
    said = [r.getMessage() for r in caplog.records if "region_a" in r.getMessage()]
    assert len(said) == 1 and "IndexError" in said[0] and "Dynamo compiles it now" in said[0], said

    calls = []

    def fails_on_the_second_call(*args):
        calls.append(1)
        if len(calls) > 1:
            raise IndexError("the step's own failure")
        return (torch.relu(args[0] * 2),)

    region._artifact, region._artifact_ran = fails_on_the_second_call, False
    assert torch.equal(region(a)[0], out[0])
    with pytest.raises(IndexError, match="the step's own"):
        region(a)


def test_artifacts_of_regions_fed_one_tensor_twice_are_built_on_two_and_give_the_same_bits(monkeypatch, tmp_path):
    """PSTAR_FX_REGION_ARTIFACTS=1 on HF Llama, whose regions receive one tensor twice (RMSNorm's aliased outputs):
    each artifact is built on distinct inputs (AOTAutograd would dedupe a repeat, and torch 2.11's artifact of such
    a graph failed at its call on the H200), every region then runs its artifact, one tensor twice included, and
    the steps give the bits of Dynamo's regions."""
    pytest.importorskip("transformers")
    from pstar_fx.passes import region_builders
    from test_hf import batches, hf_model
    data = batches("llama", 2)
    config = pstar_fx.Config(device="cpu", compute="inductor", chunk_size=CHUNK)
    plain = pstar_fx.compile(hf_model("llama", dropout=False), config, data[0])
    built = []
    save = region_builders.save_artifact

    def recording(gm, examples, path):
        ids = [id(e) for e in examples if isinstance(e, torch.Tensor)]
        built.append(len(set(ids)) == len(ids))
        return save(gm, examples, path)

    monkeypatch.setenv("PSTAR_FX_REGION_ARTIFACTS", "1")
    monkeypatch.setenv("PSTAR_FX_BUILD_WORKERS", "0")
    monkeypatch.setattr(region_builders, "save_artifact", recording)
    monkeypatch.setattr(region_builders, "artifact_path",
                        lambda key, specs, device: str(tmp_path / f"{abs(hash((key, repr(specs)))):x}.bin"))
    ours = pstar_fx.compile(hf_model("llama", dropout=False), config, data[0])
    regions = ours.graph.meta["regions"]
    assert built and all(built), built
    twice = []
    call = regions_pass.Region.__call__

    def running(region, *args):
        ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
        twice.extend([region] if len(set(ids)) < len(ids) else [])
        return call(region, *args)

    monkeypatch.setattr(regions_pass.Region, "__call__", running)
    for d in data:
        assert torch.equal(ours.step(**d), plain.step(**d))
    assert twice, "no region received one tensor twice: the case is not exercised"
    assert all(r._artifact is not None and r._artifact_ran for r in regions), \
        [r.__name__ for r in regions if r._artifact is None]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), plain.state_dict().values()))


def test_a_regions_measured_extra_memory_is_kept_for_its_next_build(monkeypatch, tmp_path):
    """On CUDA the build measures what a compiled region holds beyond its ops one by one (two runs of it); the
    figure is kept beside Inductor's caches by region key, input layouts, device and torch, so the next build of the
    same region (a warm compile) reads it instead of measuring again, and decides the same."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.relu.default, (g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)),)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    a = torch.zeros(8)
    specs = [("value", regions_pass._Layout.of(a), None)]
    measured = []

    def extra(region, examples, device):          # the measurement, stood in for (no CUDA here)
        measured.append(region.__name__)
        return 3 << 20

    monkeypatch.setattr(regions_pass, "_extra_bytes", extra)
    cuda = torch.device("cuda")
    decisions = []
    for name in ("region_first", "region_again"):
        region = regions_pass.Region(gm, name, "eager", specs, key="k")
        region.spare_bytes = 2 << 20
        regions_pass._fits_compiled(region, specs, [a], cuda)
        decisions.append(region.eager_because)
    assert measured == ["region_first"]
    assert decisions[0] == decisions[1] and "3.00 MiB more device memory" in decisions[0], decisions
    other = regions_pass.Region(gm, "region_other", "eager", specs, key="another key")
    other.spare_bytes = 4 << 20
    regions_pass._fits_compiled(other, specs, [a], cuda)
    assert measured == ["region_first", "region_other"] and other.eager_because is None
    on_cpu = regions_pass.Region(gm, "region_cpu", "eager", specs, key="k")
    on_cpu.spare_bytes = 2 << 20
    regions_pass._fits_compiled(on_cpu, specs, [a], torch.device("cpu"))     # off CUDA nothing is read or kept
    assert measured[-1] == "region_cpu" and len(list((tmp_path / "pstar_fx-extra").iterdir())) == 2
    # a cache folder that cannot be written: measured, decided, and nothing raised
    unkept = regions_pass.Region(gm, "region_unkept", "eager", specs, key="k")
    unkept.spare_bytes = 2 << 20
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a file" / "cache"))
    regions_pass._fits_compiled(unkept, specs, [a], cuda)
    assert measured[-1] == "region_unkept" and "3.00 MiB more device memory" in unkept.eager_because


@pytest.mark.parametrize("cut", ["chunk node", "span"])
def test_an_op_with_several_outputs_and_its_getitems_stay_in_one_run(cut):
    """A layer norm's three outputs taken apart by getitems, with the run cut between its first getitem and the rest:
    by a chunk node that ends a run, or (planned by block) where the next getitem's span begins (GPT3_10B on
    an H100 box, session 32: the final layer norm's region returned the norm's tuple whole and its build failed,
    "output spec mismatch"). The getitems stay with their op: no run returns a value that is not a tensor."""
    from torch.fx import Graph

    from pstar_fx.planning.blocks import SPAN
    aten = torch.ops.aten
    g = Graph()
    rt, x, w, b = (g.placeholder(n) for n in ("rt", "x", "w", "b"))
    norm = g.call_function(aten.native_layer_norm.default, (x, [8], w, b, 1e-5))
    y = g.call_function(operator.getitem, (norm, 0))
    out = g.call_function(aten.mul.Tensor, (y, y))
    if cut == "chunk node":
        g.call_method("fetch", (rt, 3))         # (the compute stream waits for a copy: a run ends)
    mean = g.call_function(operator.getitem, (norm, 1))
    rstd = g.call_function(operator.getitem, (norm, 2))
    later = g.call_function(aten.mul.Tensor, (mean, rstd))
    g.output((out, later))
    for n, span in zip((norm, y, out, mean, rstd, later), (0, 0, 0, 1, 1, 1)):
        n.meta[SPAN] = span
    runs = regions_pass.find_runs(g, by_block=cut == "span")
    for _, ops, _ in runs:
        _, outputs = regions_pass._region_io(ops)
        assert norm not in outputs and all(o.target is not aten.native_layer_norm.default for o in outputs), ops
    assert any(norm in ops and mean in ops and rstd in ops for _, ops, _ in runs)


def test_no_region_of_a_gpt_planned_by_block_returns_an_ops_tuple(monkeypatch):
    """GPT3_10B's shape with 8 layers, captured on the meta device for CUDA (its layer norms in fp32, as CUDA's autocast
    runs them) and lowered at the rates an H100 box recorded (bench/results, session 32) with a 20 GiB device budget:
    planned by block, whole-forward recompute, host chunks. The span cut that split the final layer norm's getitems
    from it there (GPT3_10B's build failed on the box: "output spec mismatch") leaves every region returning tensors."""
    import json
    import os

    import torch.nn as nn
    import torch.nn.functional as F
    from pstar_fx.pipeline.lower import Lowered
    from pstar_fx.planning.costs import assumed

    def fp32_norm(self, x):
        with torch.autocast("cpu", enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
    monkeypatch.setattr(nn.LayerNorm, "forward", fp32_norm)
    monkeypatch.setenv("PSTAR_FX_PLAN_CACHE", "0")
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "2026-12-06-h100-s32.jsonl")
    with open(path) as f:
        rates = {k: v for k, v in json.loads(f.readline())["rates"].items() if k != "device"}
    with torch.device("meta"):
        model = GPT(gpt_config("GPT3_10B", n_layer=8))
    idx = torch.randint(0, 50304, (16, 1024), device="meta")
    with assumed(**rates):
        low = Lowered(model, pstar_fx.Config(device="cuda", dtype="bf16", device_memory=20 * 2**30,
                                             host_memory="110GiB", compute="inductor"), (idx, idx))
    assert low.plan.moves.by_block and "host" in low.plan.placement
    calls = [n for n in low.graph.graph.nodes if isinstance(n.target, regions_pass.Region)]
    assert calls
    for call in calls:
        assert all(isinstance(v, torch.Tensor) for v in call.meta["val"]), (call.name, call.meta["val"])
