"""The pass list as data: printed in order with its contracts, an optional pass switched off by Config (and the step
still equal to torch.optim.AdamW), and a pipeline whose order breaks a contract refused before any pass runs."""
import dataclasses
from typing import get_args

import pytest
import torch

import pstar_fx
import pstar_fx.passes
from pstar_fx.config import OptionalPass
from pstar_fx.models import GPT, gpt_config
from pstar_fx.passes.contract import PassContractError, check_pipeline
from test_engine import assert_matches_torch, batch

PIPELINE = [
    "seed_random_ops: requires captured; provides random_ops_seeded",
    "localize_param_views: requires captured; provides param_views_local",
    "lean_cross_entropy [optional]: requires captured; provides lean_loss",
    "plan [runs recompute + fuse_optimizer]: requires param_views_local; "
    "provides optimizer_fused, planned, recompute_chosen",
    "insert_chunk_ops: requires optimizer_fused, planned; provides chunk_ops",
    "grads_in_place [optional]: requires chunk_ops; provides grads_written_in_slots",
    "compile_regions [optional, only if Config.compiles_compute]: requires chunk_ops, planned; "
    "provides compiled_regions",
]


def test_the_pipeline_lists_its_passes_and_contracts_in_order():
    assert [str(p) for p in pstar_fx.passes.PIPELINE] == PIPELINE
    check_pipeline(pstar_fx.passes.PIPELINE)
    optional = [p.name for p in pstar_fx.passes.PIPELINE if p.optional]
    assert list(get_args(OptionalPass)) == optional          # what Config.disable_passes accepts
    with pytest.raises(ValueError, match="disable_passes: 'grads_inplace' is not one of.*grads_in_place"):
        pstar_fx.Config(disable_passes=("grads_inplace",))
    with pytest.raises(ValueError, match="disable_passes: 'insert_chunk_ops' is not one of"):
        pstar_fx.Config(disable_passes=["insert_chunk_ops"])  # the passes others need cannot be switched off


def test_optional_passes_switched_off_still_train_like_torch():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = [batch(seed=s) for s in range(3)]
    engine = assert_matches_torch(model, batches, {
        "placement": "host", "chunk_size": 16384, "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1},
        "disable_passes": ("lean_cross_entropy", "grads_in_place")})
    code = engine.graph.code
    assert "rt.fetch(" in code and "grad_mm" not in code and "cross_entropy_backward_" not in code
    with pytest.raises(ValueError, match="unknown pass 'grads_in_place'"):
        engine.graph_before("grads_in_place")
    assert list(engine.lowered.graphs_before) == ["seed_random_ops", "localize_param_views", "recompute",
                                                  "fuse_optimizer", "insert_chunk_ops"]
    assert "rt.grad(" not in engine.graph_before("fuse_optimizer")
    engine.evaluate(*batches[0])                                   # evaluation's list drops it too


def test_a_broken_contract_fails_before_any_pass_runs(monkeypatch):
    ran = []

    def logged(p):
        return dataclasses.replace(p, run=lambda gm, ctx: ran.append(p.name) or p.run(gm, ctx))

    passes = [logged(p) for p in pstar_fx.passes.PIPELINE]
    names = [p.name for p in passes]
    plan, chunk_ops = names.index("plan"), names.index("insert_chunk_ops")
    passes[plan], passes[chunk_ops] = passes[chunk_ops], passes[plan]     # chunk ops before there is a plan
    in_order = [logged(p) for p in pstar_fx.passes.PIPELINE]
    monkeypatch.setattr(pstar_fx.passes, "PIPELINE", passes)
    with pytest.raises(PassContractError, match=r"pass 'insert_chunk_ops' \(step 3\) requires "
                                                r"\['optimizer_fused', 'planned'\].*lean_cross_entropy'\]"):
        pstar_fx.compile(GPT(gpt_config("tiny")), {"device": "cpu"}, batch())
    assert ran == []
    monkeypatch.setattr(pstar_fx.passes, "PIPELINE", in_order)
    pstar_fx.plan(GPT(gpt_config("tiny")), {"device": "cpu"}, batch())   # the same wrappers run when in order
    assert ran == names[:-1]                                             # compile_regions: not on the CPU


def test_a_record_reads_as_the_graph_did_when_it_was_taken(monkeypatch):
    """Records are taken cheaply and made into code when read (fxutil.code_later): each must read as its graph's
    code did when the pass received it, though later passes change that graph in place. Every record of a compile
    with chunks on both tiers (a device budget below the whole model's) and compiled regions is checked against the
    code taken eagerly."""
    import torch.fx as fx

    from pstar_fx.pipeline import lower
    eager: dict[str, str] = {}
    put = lower.GraphRecords.put

    def put_and_keep(self, name, graph):
        if isinstance(graph, fx.GraphModule):
            graph.recompile()
            eager[name] = graph.code
        put(self, name, graph)

    monkeypatch.setattr(lower.GraphRecords, "put", put_and_keep)
    monkeypatch.setattr(pstar_fx.passes.compile_regions, "BACKEND", "eager")
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    on_device = pstar_fx.plan(model, {"placement": "device", "chunk_size": 16384}, batch())
    engine = pstar_fx.compile(model, {"chunk_size": 16384, "compute": "inductor",
                                      "device_memory": on_device.device_peak_bytes * 3 // 4}, batch())
    assert "host" in engine.plan.placement
    assert set(eager) >= {"seed_random_ops", "insert_chunk_ops", "grads_in_place", "compile_regions"}
    for name, code in eager.items():
        assert engine.graph_before(name) == code, name
    assert engine.graph_before("insert_chunk_ops") != engine.graph_before("grads_in_place")   # changed in place


def test_the_passes_leave_the_collectors_frozen_objects_as_they_found_them():
    """The pass runner keeps the objects alive before it out of the garbage collector's walks while it runs
    (`gc.freeze`), and unfreezes them after; where the caller had frozen objects itself, it leaves them frozen."""
    import gc
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    assert gc.get_freeze_count() == 0
    during = []
    with pstar_fx.phases.subscribe(lambda event: during.append((event.phase, gc.get_freeze_count()))):
        pstar_fx.plan(model, {"placement": "host", "chunk_size": 16384}, batch())
    assert gc.get_freeze_count() == 0
    assert all(n == 0 for name, n in during if name == "capture") and any(n for name, n in during if name == "lower")
    mine = [object()]                       # one of the caller's objects, tracked by the collector
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pstar_fx.plan(model, {"placement": "host", "chunk_size": 16384}, batch())
        # still frozen: an unfrozen object is back in the collector's generations (gc.get_objects lists it). The
        # count may fall (a frozen object freed by its last reference, as a full cache evicts an entry: 2 of ~1M in
        # one CI run) but never rises (nothing frozen anew) nor drops to none (an unfreeze)
        assert not any(o is mine for o in gc.get_objects())
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_a_copied_graph_is_graph_copys_node_for_node():
    """fxutil.copy_graph (the recompute search's copy of the step, without create_node's walk over every argument)
    makes what torch's `graph_copy` makes: the same code, names, ops, arguments and meta, and a graph that lints
    and takes new nodes with fresh names."""
    import torch.fx as fx

    from pstar_fx.capture import capture
    from pstar_fx.fxutil import copy_graph
    torch.manual_seed(0)
    gm = capture(GPT(gpt_config("tiny")), batch(), torch.device("cpu"), torch.float32).gm
    ours, nodes = copy_graph(gm.graph)
    theirs = fx.Graph()
    theirs._codegen = gm.graph._codegen
    theirs.output(theirs.graph_copy(gm.graph, {}))
    ours.lint()
    assert fx.GraphModule(gm, ours).code == fx.GraphModule(gm, theirs).code
    assert len(ours.nodes) == len(theirs.nodes) == len(gm.graph.nodes)
    for a, b, src in zip(ours.nodes, theirs.nodes, gm.graph.nodes):
        assert (a.name, a.op, a.target, str(a.args), str(a.kwargs)) == (b.name, b.op, b.target, str(b.args), str(b.kwargs))
        assert a.meta.keys() == b.meta.keys() and a.meta is not src.meta
        assert src.op == "output" or nodes[src] is a
    first = next(iter(ours.nodes))
    with ours.inserting_after(first):
        added = ours.call_function(torch.ops.aten.clone.default, (first,))
    assert added.name not in {n.name for n in gm.graph.nodes}
    assert ours.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    # one node copied at an insert point (what the recompute pass does), as Graph.node_copy copies it
    from pstar_fx.fxutil import node_copy
    src = nodes[next(n for n in gm.graph.nodes if n.op == "call_function")]
    with ours.inserting_before(ours.output_node()):
        a = node_copy(ours, src, lambda x: x)
        b = ours.node_copy(src, lambda x: x)
    assert (a.op, a.target, a.args, a.kwargs, a.meta.keys()) == (b.op, b.target, b.args, b.kwargs, b.meta.keys())
    assert a.next is b and b.next is ours.output_node() and len({a.name, b.name, src.name}) == 3
    assert a in ours.find_nodes(op="call_function", target=src.target)
    ours.lint()


def test_a_node_copied_into_its_own_graph_gets_the_name_create_name_picks_and_hands_it_over_unused():
    """fxutil's node copies name a copy made in its own graph (the recompute pass's clones, a localized view) as
    torch's `Graph.node_copy` does, but hand `create_name` a name nobody has: torch up to 2.11 looks a taken
    numbered name's count up under the whole name and walks `mm_1`, `mm_2`, ... from the start every time
    (quadratic in the graph: 93 s of a 70B LoRA plan on the H200 box)."""
    import torch.fx as fx

    from pstar_fx.fxutil import node_copy
    g = fx.Graph()
    x = g.placeholder("x")
    mms = [g.call_function(torch.ops.aten.mm.default, (x, x)) for _ in range(50)]
    assert mms[-1].name == "mm_default_49"
    space = g._graph_namespace
    asked = []
    real = space.create_name
    space.create_name = lambda candidate, obj: (asked.append(candidate in space._used_names), real(candidate, obj))[1]
    ref = fx.Graph()
    ref.graph_copy(g, {})
    picked = []
    for src in (mms[5], mms[5], mms[49], mms[0]):
        picked.append(node_copy(g, src, lambda a: a).name)
        picked.append(ref.node_copy(src, lambda a: a).name)     # what torch names it (its graph: the same names)
    assert picked[0::2] == picked[1::2] == [f"mm_default_{i}" for i in range(50, 54)]
    assert not any(asked)
    g.lint()
