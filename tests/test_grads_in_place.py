"""grads_in_place: weight gradients written by their matmul into the chunk's gradient slot, the same bits."""
import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, Llama, gpt_config, llama_config
from test_engine import batch, tight_budget

CHUNK = 65536   # a block per chunk: where a chunk holds one parameter, its neighbour's update lies between


def _run(model, batches, cfg):
    engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", chunk_size=CHUNK, **cfg), batches[0])
    losses = [engine.step(*b) for b in batches]
    return engine, losses, engine.state_dict()


@pytest.mark.parametrize("family,dtype", [("gpt", "fp32"), ("gpt", "bf16"), ("llama", "fp32")])
def test_matmul_written_gradients_give_the_same_bits(monkeypatch, family, dtype):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny")) if family == "gpt" else Llama(llama_config("tiny"))
    batches = [batch(seed=s) for s in range(3)]
    budget, _ = tight_budget(model, batches[0], device_chunks=1, dtype=dtype, chunk_size=CHUNK)
    cfg = dict(device_memory=budget, dtype=dtype, grad_clip=0.5)
    ours, losses, state = _run(model, batches, cfg)
    writes = [n for n in ours.graph.graph.nodes if n.op == "call_method" and n.target == "grad_mm"]
    linears = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not None)
    assert len(writes) >= linears - 1, (len(writes), linears)      # all but a tied head (two contributions)
    assert "grad_mm" in ours.explain()
    plain, plain_losses, plain_state = _run(model, batches, {**cfg, "disable_passes": ("grads_in_place",)})
    assert not any(n.target == "grad_mm" for n in plain.graph.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
    # the gradients that no longer exist as tensors were in the plan: the CPU tier measures no more than it said
    assert ours.memory_stats()["device_peak_bytes"] <= ours.plan.device_peak_bytes
