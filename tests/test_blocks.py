"""planning/blocks.py: the step planned by the model's blocks, so every block's compiled region is one function.

A 6-layer GPT whose chunks (69632 elements) hold 1.4 blocks (49 280 parameters each): op by op, each chunk boundary
cuts a block's region at another op, and no two regions are alike; by block, the forward of every block is one
function and the backward another, and the steps give the uncompiled engine's bits.
"""
import collections
import sys

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.planning import blocks
import pstar_fx.passes.compile_regions  # noqa: F401  (the module, whose BACKEND the tests set)
from test_engine import batch, stated_rates, tight_budget

regions_pass = sys.modules["pstar_fx.passes.compile_regions"]
CHUNK = 69632
LAYERS = 6
# A 2-core CPU's measured rates (the development VM's), stated: the tight budget and the plans at it follow the rates
# (what is recomputed, how many compute slots), and on a fresh machine's own measurement the plan by block either
# refetched a chunk inside a block (two backward functions) or placed no chunk on the device
CPU_RATES = dict(flops=9.17e10, mem_bw=3.26e10, h2d_bw=1.78e10, d2h_bw=1.21e10, host_adam=1.43e9, host_adam_bf16=2.15e9,
                 host_adam_int8=5.6e8, host_undo=1.44e9, workspace_bytes=0, coll_bw=2e9)


@pytest.fixture
def dynamo_only(monkeypatch):
    monkeypatch.setattr(regions_pass, "BACKEND", "eager")


@pytest.fixture
def cpu_rates():
    with stated_rates(CPU_RATES):
        yield


def test_a_parameters_block_is_its_name_up_to_its_first_index():
    assert blocks.block_of("transformer.h.12.attn.c_attn.weight") == "transformer.h.12"
    assert blocks.block_of("model.layers.3.mlp.down_proj.lora_A.default.weight") == "model.layers.3"
    assert blocks.block_of("h.0.ln_1.bias") == "h.0"
    assert blocks.block_of("wte.weight") is None
    assert blocks.block_of("layer10.weight") is None        # an index is a name part of its own


def _engine(model, inputs, compute, **cfg):
    return pstar_fx.compile(model, pstar_fx.Config(device="cpu", compute=compute, chunk_size=CHUNK, **cfg), inputs)


def _calls(engine) -> collections.Counter:
    return collections.Counter(n.target for n in engine.graph.graph.nodes if isinstance(n.target, regions_pass.Region))


def test_every_blocks_region_is_one_function_and_the_bits_hold(dynamo_only, cpu_rates, monkeypatch):
    """Planned by block (taken whatever it costs: on the CPU tier this tiny step is a millisecond, of which a block's
    delay in copies and updates is 1-3%), one function runs every block's forward and one every block's backward,
    and the steps give the uncompiled engine's bits. The planner's own choice here is the plan op by op: by block
    it estimates more than `SPANS_MAY_COST` slower."""
    from pstar_fx.planning import planner
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=LAYERS))
    batches = [batch(seed=s) for s in range(3)]
    budget, _ = tight_budget(model, batches[0], device_chunks=1, chunk_size=CHUNK, compute="inductor")
    cfg = dict(device_memory=budget, grad_clip=0.5)
    chosen = _engine(model, batches[0], "inductor", **cfg)
    with monkeypatch.context() as m:
        m.setenv("PSTAR_FX_SPANS_MAY_COST", "1")
        ours = _engine(model, batches[0], "inductor", **cfg)
    assert {"device", "host"} <= set(ours.plan.placement), ours.plan.placement
    calls = _calls(ours)
    # every block's forward, every block's backward
    most, second = sorted(calls.values())[-1], sorted(calls.values())[-2]
    assert most == second == LAYERS and len(calls) <= 6, calls
    assert ours.plan.moves.updates_after, "no update was planned at its block's end"
    assert any(n.startswith("planned by block") for n in ours.plan.notes), ours.plan.notes
    assert not any(n.startswith("planned by block") for n in chosen.plan.notes), chosen.plan.notes
    assert not chosen.plan.moves.updates_after
    assert chosen.plan.estimated_step_seconds < ours.plan.estimated_step_seconds * (1 - planner.SPANS_MAY_COST)
    assert len(_calls(chosen)) > len(calls), (_calls(chosen), calls)   # op by op: a function for almost every call
    assert not chosen.plan.moves.by_block and ours.plan.moves.by_block
    # a plan op by op keeps its regions as without blocks (cut at blocks too, they would be more, not fewer)
    with monkeypatch.context() as m:
        m.setenv("PSTAR_FX_BLOCK_SPANS", "0")
        assert _calls(_engine(model, batches[0], "inductor", **cfg)).total() == _calls(chosen).total()

    plain = _engine(model, batches[0], "eager", **cfg)
    for b in batches:
        assert torch.equal(ours.step(*b), plain.step(*b))
    a, b = ours.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_spans_follow_the_blocks_and_never_go_back(monkeypatch):
    """Forward: the embeddings, each block, the head; backward: the head, each block in reverse, each cut after the
    ops every block's backward runs (the view the next block reads, and after the first block the embeddings'
    gradients, are spans of their own), so every block's span runs the same ops in each half (a node reading a
    block already passed, as backward's recompute does, stays in the span it falls in)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=3))
    engine = _engine(model, batch(), "inductor", placement="device", disable_passes=("compile_regions",))
    ops = [n for n in engine.graph.graph.nodes if n.op == "call_function"]
    spans = [n.meta.get(blocks.SPAN) for n in ops]
    marked = [s for s in spans if s is not None]
    assert marked == sorted(marked), "a span comes back"
    assert len(marked) == len(spans)       # every op is in one
    # forward: embeddings, 3 blocks, head; backward: head, 3 blocks, the 2 views after the last two, embeddings
    assert sorted(set(marked)) == list(range(5 + 1 + 3 + 2 + 1)), sorted(set(marked))
    runs = collections.defaultdict(list)
    for n, s in zip(ops, spans):
        runs[s].append(n.target)
    assert runs[1] == runs[2] == runs[3]                    # the blocks' forward
    assert runs[6] == runs[8] == runs[10] and runs[7] == runs[9] == [torch.ops.aten.view.default]
    assert torch.ops.aten.embedding_dense_backward.default in runs[11]
    monkeypatch.setenv("PSTAR_FX_BLOCK_SPANS", "0")
    engine = _engine(model, batch(), "inductor", placement="device", disable_passes=("compile_regions",))
    assert not any(blocks.SPAN in n.meta for n in engine.graph.graph.nodes)


def test_spans_are_cut_to_the_ops_repeated_blocks_run():
    """Backward's block spans (the letters stand for ops): three blocks run P, whose last op is the view the next
    block reads; two recompute (R: P with recomputed ops amid it, a pattern of its own); the first block runs P but
    its view and then the embeddings' gradients. P is cut before its view, and so is the first block, whose P part
    is then every block's; R stays whole; the forward's equal spans stay as they are."""
    import torch.fx as fx
    from pstar_fx.planning.blocks import _cut_to_the_pattern
    aten = torch.ops.aten
    op = dict(A=aten.add.Tensor, M=aten.mul.Tensor, S=aten.sub.Tensor, N=aten.neg.default, E=aten.exp.default,
              V=aten.view.default, G=aten.embedding_dense_backward.default)
    forward, pattern = "AMSNE", "AMSNEAMSNEAMV"
    recomputed = "NN" + pattern[:5] + "NN" + pattern[5:]
    spans = [(False, "h.0"), (False, "h.1"), (False, "h.2"), (True, None),
             (True, "h.5"), (True, "h.4"), (True, "h.3"), (True, "h.2"), (True, "h.1"), (True, "h.0")]
    letters = [forward] * 3 + ["A"] + [pattern] * 3 + [recomputed] * 2 + [pattern[:-1] + "GGA"]
    g = fx.Graph()
    x = g.placeholder("x")
    for s, word in enumerate(letters):
        for ch in word:
            x = g.call_function(op[ch], (x,))
            x.meta[blocks.SPAN] = s
    g.output(x)
    n = _cut_to_the_pattern(g, spans)
    runs = collections.defaultdict(str)
    for node in g.nodes:
        if blocks.SPAN in node.meta:
            runs[node.meta[blocks.SPAN]] += next(k for k, v in op.items() if v == node.target)
    marked = [node.meta[blocks.SPAN] for node in g.nodes if blocks.SPAN in node.meta]
    assert marked == sorted(marked) and n == len(runs) == max(marked) + 1
    assert list(runs.values()) == [forward] * 3 + ["A"] + [pattern[:-1], "V"] * 3 + [recomputed] * 2 + [
        pattern[:-1], "GGA"], list(runs.values())


def test_a_span_is_widened_only_up_to_the_limit_and_its_updates_move_to_its_end():
    """Nodes 0-2 in span 0 reading chunks 0 and 1; nodes 3-6 in span 1 reading chunks 1, 2 and 3 (more than the
    limit of 2: left op by op). Updates (nodes without a span) move to the end of a widened span they fall in."""
    reads = [{0}, set(), {1}, {1}, {2}, set(), {3}, set(), set()]
    spans = [0, 0, 0, 1, 1, 1, 1, None, None]
    widened_reads, widened = blocks.widen(reads, spans, limit=2)
    assert widened == {0}
    assert widened_reads[0] == widened_reads[2] == {0, 1} and widened_reads[1] == set()
    assert widened_reads[3:] == reads[3:]
    spans_with_updates = [0, 0, None, 0, 1, None, 1, 1]     # updates at 2 (after span 0's node 1) and 5 (in span 1)
    moved = blocks.updates_at_ends({7: 2, 8: 5}, spans_with_updates, widened={0})
    assert moved == {7: 3}          # to span 0's last node; span 1 is not widened: its update stays
    assert blocks.bounds(spans_with_updates) == {0: (0, 3), 1: (4, 7)}


@pytest.mark.parametrize("name, value", [("PSTAR_FX_BLOCK_SPANS", "off"), ("PSTAR_FX_SPANS_MAY_COST", "-0.1"),
                                         ("PSTAR_FX_SPANS_MAY_COST", "half"), ("PSTAR_FX_SPANS_MAY_COST", "nan")])
def test_a_bad_setting_is_an_error_naming_it(monkeypatch, name, value):
    from pstar_fx.planning import planner
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        blocks.enabled() if name == "PSTAR_FX_BLOCK_SPANS" else planner.spans_may_cost()
