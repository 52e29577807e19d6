"""lean_cross_entropy: cross-entropy's backward in place of its saved log-probabilities, exactly."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pstar_fx
from pstar_fx.models import GPT, gpt_config

sys.path.insert(0, os.path.dirname(__file__))
from test_engine import assert_matches_torch, batch  # noqa: E402


class Classifier(nn.Module):
    def __init__(self, reduction, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)
        self.reduction = reduction

    def forward(self, idx, tgt):
        logits = self.head(torch.tanh(self.emb(idx))).flatten(0, 1)
        loss = F.cross_entropy(logits, tgt.flatten(), reduction=self.reduction, ignore_index=-100)
        return loss if self.reduction != "none" else loss.square().mean()   # a non-uniform grad_output


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_with_ignored_targets(reduction):
    torch.manual_seed(0)
    model = Classifier(reduction)
    batches = []
    for s in range(3):
        idx, tgt = batch(vocab=64, b=4, t=16, seed=s)
        tgt[:, ::3] = -100                                  # ignored positions get no gradient
        batches.append((idx, tgt))
    engine = assert_matches_torch(model, batches, {"optimizer": {"lr": 1e-2}})
    assert "cross_entropy_backward_" in engine.graph.code
    assert "nll_loss_backward" not in engine.graph.code


def test_bf16_gpt_loss_peak_drops_by_one_to_two_log_prob_tensors(monkeypatch):
    """The planner's activation peak for a GPT whose loss dominates falls by one to two N x V fp32 tensors
    (two in backward; the forward, which holds the fp32 logits and their log_softmax at once, may then
    become the peak)."""
    with torch.device("meta"):
        model = GPT(gpt_config("GPT2small", n_layer=2, vocab_size=50257, block_size=1024))
    idx = torch.zeros(16, 1024, dtype=torch.long, device="meta")     # the loss is the widest tensor
    cfg = {"device": "cpu", "dtype": "bf16"}
    lean = pstar_fx.plan(model, cfg, (idx, idx))
    skipped = []                                                     # the same plan without the pass
    monkeypatch.setattr("pstar_fx.passes.lean_loss.lean_cross_entropy", lambda gm: skipped.append(gm) or gm)
    plain = pstar_fx.plan(model, cfg, (idx, idx))
    assert skipped
    log_probs = 16 * 1024 * 50257 * 4
    saved = plain.activation_peak_bytes - lean.activation_peak_bytes
    print(f"activation peak {plain.activation_peak_bytes / 2**30:.2f} GiB -> "
          f"{lean.activation_peak_bytes / 2**30:.2f} GiB")
    assert 0.9 * log_probs <= saved <= 2.05 * log_probs, (saved, log_probs)
