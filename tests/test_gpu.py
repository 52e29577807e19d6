"""On the GPU machine: the CUDA runtime against the CPU fp32 reference, and the plan against the allocator."""
import copy

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config

pytestmark = pytest.mark.gpu


def _batches(n, vocab=256, b=4, t=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g))
            for _ in range(n)]


def test_bf16_on_gpu_tracks_cpu_fp32_reference_with_host_offload():
    torch.manual_seed(0)
    model = GPT(gpt_config("small"))
    ref = copy.deepcopy(model)
    batches = _batches(20)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for idx, tgt in batches:
        opt.zero_grad()
        loss = ref(idx, tgt)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": "host",
                                      "optimizer": {"lr": 1e-3}}, batches[0])
    losses = [engine.step(idx.cuda(), tgt.cuda()).item() for idx, tgt in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=0)
    stats = engine.memory_stats()
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    phases = engine.rt.timing()
    assert set(phases) == {"compute_waits_for_copies", "host_adam", "wait_for_host_grad_buffer", "wait_for_host_adam",
                           "correction"}
    assert phases["host_adam"] > 0 and all(v >= 0 for v in phases.values())


@pytest.mark.parametrize("placement", ["device", "host"])
def test_plan_predicts_gpu_peak_within_10_percent(placement):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config("GPT2small", block_size=512))
    idx = torch.randint(0, 50304, (8, 512), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": placement}, (idx, idx))
    for _ in range(3):
        engine.step(idx, idx)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = engine.plan.device_peak_bytes
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)
