"""Checkpoints: N steps, save, load into a fresh engine of another budget and chunk size, M more steps equal
N + M uninterrupted steps bit for bit (CPU, fp32); the files are safetensors; a save that dies leaves the
previous checkpoint whole; a checkpoint of another model is an error that changes nothing."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_engine import WithBuffers, batch, regression_batches, tight_budget

import pstar_fx
import pstar_fx.checkpoint as ckpt
from pstar_fx.models import GPT, Llama, gpt_config, llama_config

OPT = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}


def build(name):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(gpt_config("tiny")), [batch(seed=s) for s in range(5)]
    if name == "llama":
        return Llama(llama_config("tiny")), [batch(seed=s) for s in range(5)]
    return WithBuffers(), regression_batches(5)


def engine_for(model, inputs, chunk_size, device_chunks, resume=None, **cfg):
    budget, _ = tight_budget(model, inputs, device_chunks=device_chunks, chunk_size=chunk_size)
    return pstar_fx.compile(model, dict({"device": "cpu", "device_memory": budget, "chunk_size": chunk_size,
                                         "optimizer": OPT}, **cfg), inputs, resume=resume)


@pytest.mark.parametrize("name", ["gpt", "llama", "batchnorm"])
def test_resume_elsewhere_is_bit_exact(tmp_path, name):
    model, batches = build(name)
    sizes = (16384, 32768) if name != "batchnorm" else (1024, 2048)
    steady = engine_for(model, batches[0], sizes[0], 1, lr_schedule={"type": "linear", "warmup_steps": 1,
                                                                       "total_steps": 6})
    losses = [steady.step(*b).item() for b in batches]
    first = engine_for(model, batches[0], sizes[0], 1, lr_schedule={"type": "linear", "warmup_steps": 1,
                                                                      "total_steps": 6})
    for b in batches[:2]:
        first.step(*b)
    first.save(tmp_path / "ck")
    # another chunk size and another device budget: the checkpoint speaks names, not chunk ids
    second = engine_for(model, batches[0], sizes[1], 2, lr_schedule={"type": "linear", "warmup_steps": 1,
                                                                       "total_steps": 6}, resume=tmp_path / "ck")
    assert second.lowered.layout.chunk_size != first.lowered.layout.chunk_size
    assert second.steps == 2 and second.lr == first.lr
    resumed = [second.step(*b).item() for b in batches[2:]]
    assert resumed == losses[2:]
    a, b = second.state_dict(), steady.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    for k, v in steady.persistent_buffers().items():
        assert torch.equal(second.persistent_buffers()[k], v), k


def test_the_files_are_safetensors_under_the_model_s_names(tmp_path):
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    engine.step(*batches[0])
    engine.save(tmp_path / "ck")
    weights = load_file(str(tmp_path / "ck" / ckpt.WEIGHTS))
    sd = engine.state_dict()
    cap = engine.lowered.capture
    assert any(len(p.aliases) > 1 for p in cap.params)                   # the GPT ties its embedding and head
    assert set(weights) == {p.name for p in cap.params} | set(engine.persistent_buffers())   # a tied one once
    for k, v in weights.items():
        assert torch.equal(v, sd[k]), k
    moments = load_file(str(tmp_path / "ck" / ckpt.OPTIMIZER))
    assert {k.rsplit(".", 1)[0] for k in moments} <= set(sd) and any(k.endswith(".exp_avg_sq") for k in moments)
    state = json.loads((tmp_path / "ck" / ckpt.STATE).read_text())
    assert state["step"] == 1 and state["optimizer"]["type"] == "adamw"
    engine.save(tmp_path / "bf", dtype="bf16")
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "bf" / ckpt.WEIGHTS)).values())


def test_sharded_weights_have_the_index_transformers_reads(tmp_path, monkeypatch):
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    monkeypatch.setattr(ckpt, "SHARD_BYTES", 64 * 1024)
    ckpt.save(engine, tmp_path / "ck", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "ck" / ckpt.INDEX).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / "ck" / s).exists() for s in shards)
    fresh = engine_for(model, batches[0], 32768, 2, resume=tmp_path / "ck")
    a, b = fresh.state_dict(), engine.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    (tmp_path / "ck" / sorted(shards)[0]).unlink()
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="missing"):
        fresh.load(tmp_path / "ck")


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    engine.step(*batches[0])
    engine.save(tmp_path / "ck")
    saved = engine.state_dict()
    engine.step(*batches[1])
    real, calls = ckpt.write_safetensors, []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(ckpt.save_load, "write_safetensors", dies)
    with pytest.raises(KeyboardInterrupt):
        engine.save(tmp_path / "ck")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]             # nothing half-written left behind
    fresh = engine_for(model, batches[0], 16384, 1, resume=tmp_path / "ck")
    assert fresh.steps == 1 and all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def test_bad_checkpoints_raise_and_change_nothing(tmp_path):
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    engine.step(*batches[0])
    before = engine.state_dict()
    other, other_batches = build("llama")
    engine_for(other, other_batches[0], 16384, 1).save(tmp_path / "llama")
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="does not match.*missing"):
        engine.load(tmp_path / "llama")
    (tmp_path / "empty").mkdir()
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="not a checkpoint"):
        engine.load(tmp_path / "empty")
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="no such checkpoint"):
        engine.load(tmp_path / "nowhere")
    engine.save(tmp_path / "mine")
    (tmp_path / "mine" / ckpt.STATE).write_text(json.dumps({"optimizer": {"type": "adam"}}))
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="optimizer type 'adam'"):
        engine.load(tmp_path / "mine")
    # a truncated loop-state file (a save killed while writing it, a bad copy): named, not a raw JSONDecodeError
    (tmp_path / "mine" / ckpt.STATE).write_text('{"step": 1, "optimizer": {"ty')
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match=f"{ckpt.STATE}: not valid JSON.*truncated"):
        engine.load(tmp_path / "mine")
    with open(tmp_path / "mine" / ckpt.WEIGHTS, "r+b") as f:
        f.truncate(100)
    with pytest.raises(pstar_fx.checkpoint.CheckpointError):
        engine.load(tmp_path / "mine")
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.steps == 1


def test_weights_only_folder_loads_with_fresh_moments(tmp_path):
    from safetensors.torch import save_file
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    for b in batches[:2]:
        engine.step(*b)
    sd = {k: v for k, v in engine.state_dict().items() if k != "lm_head.weight"}   # tied: stored once
    (tmp_path / "w").mkdir()
    save_file(sd, str(tmp_path / "w" / ckpt.WEIGHTS))
    fresh = engine_for(model, batches[0], 16384, 1, resume=tmp_path / "w")
    assert fresh.steps == 0
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in sd.items())
    assert all(float(t.abs().max()) == 0 for t in fresh.rt.store.exp_avg)


def test_export_into_a_meta_built_model_keeps_its_views_of_the_masters():
    """A model built on meta has its weights made in chunk memory (its parameters are views of the masters):
    export leaves those views as they are (they hold the trained weights; PstarTrainer exports at the end of
    train() and a whole fp32 copy would cost 4 B/param of host memory there) and equal the state_dict."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    batches = [batch(seed=s) for s in range(3)]
    engine = pstar_fx.compile(model, {"device": "cpu", "chunk_size": 16384, "optimizer": OPT}, batches[0])
    for b in batches:
        engine.step(*b)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert engine.export(model) is model
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    sd = engine.state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    other = GPT(gpt_config("tiny"))              # a model of its own memory: every weight written
    engine.export(other)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in sd.items())


def test_load_state_dict_and_export():
    model, batches = build("batchnorm")
    engine = engine_for(model, batches[0], 1024, 1)
    for b in batches[:3]:
        engine.step(*b)
    sd = engine.state_dict()
    assert "bn.running_mean" in sd and "bn.num_batches_tracked" in sd      # buffers, as the model's state_dict
    target = build("batchnorm")[0]
    engine.export(target)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in sd.items())
    fresh = engine_for(build("batchnorm")[0], batches[0], 2048, 2)
    fresh.load_state_dict(sd)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in sd.items())
    before = fresh.state_dict()
    bad = dict(sd, **{"fc1.weight": torch.zeros(3, 3)})
    bad.pop("fc2.bias")
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match=r"missing fc2.bias.*fc1.weight: shape \(3, 3\)"):
        fresh.load_state_dict(bad)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    partial = {k: v for k, v in sd.items() if k != "fc2.bias"}
    fresh.load_state_dict(partial, strict=False)                           # as torch: missing names allowed
    with pytest.raises(pstar_fx.checkpoint.CheckpointError, match="missing fc2.bias"):
        fresh.load_state_dict(partial)


_CHILD = r"""
import sys, time, torch, pstar_fx
import pstar_fx.checkpoint as ckpt
from pstar_fx.models import GPT, gpt_config
real = ckpt.write_safetensors
def slow(path, entries, meta, blocks=None):         # slow writes, so a kill lands inside one
    return real(path, [(n, d, s, (lambda p=p: (time.sleep(0.002), p())[1])) for n, d, s, p in entries], meta,
                blocks)
ckpt.save_load.write_safetensors = slow
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
idx = torch.randint(0, 256, (2, 32), generator=g)
engine = pstar_fx.compile(GPT(gpt_config("tiny")), {"device": "cpu", "placement": "host"}, (idx, idx))
engine.step(idx, idx)
engine.save(sys.argv[1])
print("saved", flush=True)
while True:
    engine.step(idx, idx)
    engine.save(sys.argv[1])
"""


@pytest.mark.parametrize("delay", [0.05, 0.17, 0.4])
def test_a_killed_save_leaves_a_loadable_checkpoint(tmp_path, delay):
    import signal
    import subprocess
    import sys
    import time
    path = tmp_path / "ck"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (2, 32), generator=g)
    engine = pstar_fx.compile(GPT(gpt_config("tiny")), {"device": "cpu", "placement": "host"}, (idx, idx),
                              resume=path)                   # whole: the last save that finished, or the one before
    assert engine.steps >= 1
    engine.step(idx, idx)
    engine.save(path)                 # the killed save's folders (.ck.tmp-PID, .ck.old-PID) are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_save_removes_what_dead_saves_left_and_nothing_of_a_live_one(tmp_path):
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()                                   # the process that started pytest: running
    left = [f".ck.tmp-{dead.pid}", f".ck.old-{dead.pid}", f".other.tmp-{dead.pid}",   # a dead save's
            f".ck.tmp-{live}", f".ck.old-{live}",                                   # a live process's
            f".gone.old-{dead.pid}"]     # a dead save's previous checkpoint of a folder no longer there: the only copy
    for name in left:
        (tmp_path / name).mkdir()
    model, batches = build("batchnorm")
    engine = engine_for(model, batches[0], 1024, 1)
    engine.save(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", f".ck.tmp-{live}", f".ck.old-{live}",
                                                                   f".gone.old-{dead.pid}"])


@pytest.mark.parametrize("name", ["gpt", "batchnorm"])
def test_evaluate_is_the_eager_loss_in_eval_mode_and_changes_nothing(name):
    import copy
    model, batches = build(name)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), **{k: v for k, v in OPT.items() if k != "type"})
    engine = engine_for(model, batches[0], 16384 if name == "gpt" else 1024, 1)
    for b in batches[:2]:
        engine.step(*b)
        opt.zero_grad()
        ref(*b).backward()
        opt.step()
    weights, moments = engine.state_dict(), [t.clone() for t in engine.rt.store.exp_avg_sq]
    ref.eval()
    with torch.no_grad():
        want = ref(*batches[3]).item()
    got = engine.evaluate(*batches[3]).item()
    assert got == pytest.approx(want, rel=1e-5)
    after = engine.state_dict()
    assert all(torch.equal(after[k], v) for k, v in weights.items())       # buffers (BN statistics) too
    assert all(torch.equal(a, b) for a, b in zip(engine.rt.store.exp_avg_sq, moments)) and engine.steps == 2
    engine.step(*batches[2])                                               # training goes on
    assert engine.steps == 3
    if name == "gpt":
        big = tuple(torch.cat([x] * 64) for x in batches[3])                 # far past the device budget
        with pytest.raises(pstar_fx.BudgetError, match="evaluation at input shapes"):
            engine.evaluate(*big)


def test_not_enough_disk_is_said_before_writing(tmp_path, monkeypatch):
    import collections
    model, batches = build("gpt")
    engine = engine_for(model, batches[0], 16384, 1)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.save_load.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match="not enough disk.*nothing was written"):
        engine.save(tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


# ---- clipping resumes elsewhere bit for bit: the global norm does not depend on the layout ---------------

# (chunk size, device chunks, extra config) of the saving run and of the resuming one; the tiny BatchNorm model
# has no budget between "one chunk's state on the device" and "all of it", so it saves with all state on the host
CLIP_LAYOUTS = {"gpt": ((16384, 1, {}), (32768, 2, {})), "llama": ((16384, 1, {}), (32768, 2, {})),
                "batchnorm": ((1024, 1, {"placement": "host"}), (2048, 1, {}))}


def build_clipped(name):
    """As `build`, but the BatchNorm model wide enough (1217 elements) to split into two 1024-element chunks."""
    if name != "batchnorm":
        return build(name)
    torch.manual_seed(0)
    return WithBuffers(d=64), regression_batches(5)


def clipped_engine(model, inputs, chunk_size, device_chunks, resume=None, **cfg):
    """engine_for at the tight budget."""
    budget, _ = tight_budget(model, inputs, device_chunks=device_chunks, chunk_size=chunk_size)
    return pstar_fx.compile(model, dict({"device": "cpu", "device_memory": budget, "chunk_size": chunk_size,
                                         "optimizer": OPT}, **cfg), inputs, resume=resume)


def moments_by_name(engine) -> dict[str, torch.Tensor]:
    store = engine.rt.store
    return {f"{p.name}.{key}": store.moment(i, key) for i, p in enumerate(engine.lowered.capture.params)
            if p.has_grad for key in ckpt.MOMENTS}


def assert_same_state(a, b):
    """Every weight, buffer and moment of engine a equals engine b's, bit for bit."""
    wa, wb = a.state_dict(), b.state_dict()
    assert wa.keys() == wb.keys()
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k
    ma, mb = moments_by_name(a), moments_by_name(b)
    assert ma.keys() == mb.keys()
    for k in mb:
        assert torch.equal(ma[k], mb[k]), k


@pytest.mark.parametrize("clip", [0.01, 100.0], ids=["clips", "does_not_clip"])
@pytest.mark.parametrize("name", ["gpt", "llama", "batchnorm"])
def test_clipped_resume_elsewhere_is_bit_exact(tmp_path, name, clip):
    """N clipped steps, save, load into a fresh engine (a freshly built model) of another chunk size and device
    budget (another placement: some chunks on the host in one, not in the other), M more steps: equal to N + M
    uninterrupted steps bit for bit, weights and moments."""
    ((a, da, ca), (b, db, cb)), n = CLIP_LAYOUTS[name], 2
    model, batches = build_clipped(name)
    steady = clipped_engine(model, batches[0], a, da, grad_clip=clip, **ca)
    reports = []
    for x in batches:
        steady.step(*x)
        reports.append(steady.last_step)
    assert all(r.clip_coef < 1.0 for r in reports) if clip < 1 else all(r.clip_coef == 1.0 for r in reports)
    first = clipped_engine(build_clipped(name)[0], batches[0], a, da, grad_clip=clip, **ca)
    for x in batches[:n]:
        first.step(*x)
    first.save(tmp_path / "ck")
    second = clipped_engine(build_clipped(name)[0], batches[0], b, db, grad_clip=clip, resume=tmp_path / "ck", **cb)
    assert second.lowered.layout.chunk_size != first.lowered.layout.chunk_size
    assert second.plan.placement != first.plan.placement and "host" in first.plan.placement
    assert second.steps == n
    for x, r in zip(batches[n:], reports[n:]):
        second.step(*x)
        assert second.last_step.grad_norm == r.grad_norm and second.last_step.clip_coef == r.clip_coef
    assert_same_state(second, steady)


def test_clipped_accumulating_resume_elsewhere_is_bit_exact(tmp_path):
    """The same with gradient accumulation: the norm is taken over the fp32 accumulators, per parameter."""
    model, micro = build_clipped("gpt")                # the example inputs are one micro-batch
    batches = [tuple(torch.cat(parts) for parts in zip(x, y)) for x, y in zip(micro, micro[1:] + micro[:1])]
    steady = clipped_engine(model, micro[0], 16384, 1, grad_clip=0.01, grad_accum=2)
    for x in batches:
        steady.step(*x)
    assert steady.last_step.clip_coef < 1.0
    first = clipped_engine(build_clipped("gpt")[0], micro[0], 16384, 1, grad_clip=0.01, grad_accum=2)
    for x in batches[:2]:
        first.step(*x)
    first.save(tmp_path / "ck")
    second = clipped_engine(build_clipped("gpt")[0], micro[0], 32768, 2, grad_clip=0.01, grad_accum=2,
                        resume=tmp_path / "ck")
    for x in batches[2:]:
        second.step(*x)
    assert_same_state(second, steady)


@pytest.mark.parametrize("accum", [1, 2])
def test_grad_norm_is_bit_identical_across_chunk_sizes_and_placements(monkeypatch, accum):
    """The same weights and batch under three layouts (chunk size, device budget, all state on the host), their
    host chunks' partial sums measured inline or on the host worker (each mode meets the all-host layout at one
    of the two accumulation settings): the step's sum of squares (float64, before the fp32 norm rounds it) and
    its norm have the same bits."""
    import pstar_fx.runtime.chunk_ops as chunk_ops_module
    import pstar_fx.runtime.updater as updater_module
    sums, verdict = [], updater_module.Updater.verdict
    monkeypatch.setattr(updater_module.Updater, "verdict", lambda self: sums.append(verdict(self)) or sums[-1])
    model, batches = build_clipped("llama")
    x = tuple(torch.cat([t, u]) for t, u in zip(batches[0], batches[1]))
    norms, placements = [], []
    worker = accum == 1
    for chunk_size, device_chunks, placement in [(16384, 1, None), (32768, 2, None), (24576, 0, "host")]:
        worker = not worker                  # accum 1: inline, worker, inline; accum 2: worker, inline, worker
        monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", worker)   # read when the runtime is built
        cfg = {"grad_clip": 0.01, "grad_accum": accum} | ({"placement": placement} if placement else {})
        engine = clipped_engine(model, batches[0] if accum > 1 else x, chunk_size, max(device_chunks, 1), **cfg)
        placements.append(engine.plan.placement)
        engine.step(*x)
        norms.append(engine.last_step.grad_norm)
    assert len(set(map(tuple, placements))) == 3 and all(p == "host" for p in placements[2])
    assert len(sums) == 3 and len(set(sums)) == 1, sums
    assert len(set(norms)) == 1, norms


_RESUME_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_checkpoint import build_clipped, clipped_engine
model, batches = build_clipped("gpt")
engine = clipped_engine(model, batches[0], 16384, 1, grad_clip=0.01)
for x in batches[:2]:
    engine.step(*x)
engine.save(sys.argv[1])
"""


def test_clipped_resume_in_a_fresh_process_is_bit_exact(tmp_path):
    """The saving run is another process: nothing carried over but the files."""
    import subprocess
    import sys
    from pathlib import Path
    # the uninterrupted run needs nothing of the child's, so it runs here while the child saves (two cores)
    child = subprocess.Popen([sys.executable, "-c", _RESUME_CHILD, str(tmp_path / "ck"), str(Path(__file__).parent)])
    try:
        model, batches = build_clipped("gpt")
        steady = clipped_engine(model, batches[0], 16384, 1, grad_clip=0.01)
        for x in batches:
            steady.step(*x)
        assert child.wait(timeout=300) == 0
    finally:
        child.kill()
    second = clipped_engine(build_clipped("gpt")[0], batches[0], 32768, 2, grad_clip=0.01, resume=tmp_path / "ck")
    assert second.steps == 2
    for x in batches[2:]:
        second.step(*x)
    assert_same_state(second, steady)
