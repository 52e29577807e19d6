"""The host worker's order: jobs in the order queued, except backward's host updates of a pass that has ended, which
run in the order the next forward reads their chunks, each once its gradient has landed (runtime/host_worker.py) —
and a training run whose host updates so reordered equals the same run with them inline, and torch."""
import threading

import pytest
import torch
from test_transaction import assert_run_matches, compile_gpt, gpt_batches, reference, run, tiny_gpt

import pstar_fx.runtime.chunk_ops as chunk_ops_module
import pstar_fx.runtime.updater as updater_module
from pstar_fx.runtime.host_worker import HostWorker
from pstar_fx.runtime.telemetry import Telemetry


class Queued:
    """A threaded worker held by a first job until `release()`, so that the jobs queued meanwhile wait together;
    `order` records the chunks of the jobs as they run."""

    def __init__(self):
        self.worker = HostWorker(Telemetry(), threaded=True)
        self.order, self.landed, self.gate = [], {}, threading.Event()
        self.worker.run(-1, None, self.gate.wait)

    def update(self, c: int, tag: str = "") -> None:
        """Backward's update of chunk c (its gradient lands when `landed[c]` says so)."""
        self.landed.setdefault(c, False)
        self.worker.run(c, None, self.order.append, f"{c}{tag}", landed=lambda: self.landed[c])

    def other(self, c: int, tag: str) -> None:
        """A job that is not a backward update (a correction, a restore): it keeps its place."""
        self.worker.run(c, None, self.order.append, f"{c}{tag}")

    def release(self) -> list[str]:
        self.gate.set()
        for f in list(self.worker.pending.values()):
            f.result(timeout=30)
        self.worker.executor.shutdown(wait=True)
        return self.order


def test_updates_of_an_open_pass_run_in_the_order_queued():
    q = Queued()
    for c in (5, 4, 3, 2):
        q.update(c)
        q.landed[c] = True
    assert q.release() == ["5", "4", "3", "2"]      # the launching thread may still queue more: nothing overtakes


def test_an_ended_pass_runs_its_landed_updates_lowest_chunk_first_and_the_jobs_after_them_last():
    q = Queued()
    for c in (5, 4, 3, 2):
        q.update(c)
    q.other(5, "correction")
    q.worker.close_pass()
    q.landed.update({5: True, 3: True, 2: True})          # chunk 4's gradient has not landed
    assert q.release() == ["2", "3", "5", "4", "5correction"]


def test_an_ended_pass_with_no_gradient_landed_takes_the_first_queued():
    q = Queued()
    for c in (5, 4, 3):
        q.update(c)
    q.worker.close_pass()
    assert q.release() == ["5", "4", "3"]       # (backward's copies land in that order)


def test_two_ended_passes_do_not_mix():
    q = Queued()
    for c in (3, 2):
        q.update(c, "a")
    q.worker.close_pass()
    for c in (3, 1):
        q.update(c, "b")
    q.worker.close_pass()
    q.landed.update({1: True, 2: True, 3: True})
    assert q.release() == ["2a", "3a", "1b", "3b"]      # chunk 3's second update after its first


def test_a_job_that_fails_raises_where_it_is_waited_for():
    worker = HostWorker(Telemetry(), threaded=True)

    def boom():
        raise ValueError("boom")
    worker.run(0, None, boom, landed=lambda: True)
    worker.close_pass()
    with pytest.raises(ValueError, match="boom"):
        worker.wait_for(0, None)
    worker.executor.shutdown(wait=True)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_host_updates_in_the_forwards_order_change_no_bit(monkeypatch, clip):
    """Host Adam on its worker thread (as on CUDA), kept_grads, most chunks on the host: each step's first host update
    to run is held until the step's pass has ended, so the others wait together and run lowest chunk first (the next
    forward's order; in backward's they come deepest first). The run equals torch's; unclipped, every master and moment
    equals the same run with the host jobs inline, bit for bit. (Clipped, the held updates start after the verdict
    and apply its coefficient at once, where inline ones are corrected after it: the same within the correction's
    contract, not bit for bit.)"""
    model, batches = tiny_gpt(), gpt_batches(4)
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    runs = {}
    for threaded in (False, True):
        monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", threaded)
        engine = compile_gpt(model, grad_clip=clip, transaction="kept_grads")
        store = engine.rt.store
        host = sorted(c for c in range(len(store.master)) if store.tier(c) == "host")
        order, ended = {}, {}          # step log -> the host chunks updated, as they ran; the pass ended
        logs = []                      # every step log seen, held: a freed one's id could name the next step's
        with monkeypatch.context() as m:
            if threaded:
                real_job, real_queued = updater_module.Updater._host_job, updater_module.Updater.pass_queued

                def host_job(self, c, grad, ready, log, *a, **k):
                    if id(log) not in order:            # the step's first to run: held till its pass has ended
                        order[id(log)] = []
                        logs.append(log)
                        assert ended.setdefault(id(log), threading.Event()).wait(30)
                    order[id(log)].append(c)
                    return real_job(self, c, grad, ready, log, *a, **k)

                def pass_queued(self):
                    real_queued(self)
                    logs.append(self.step_log)
                    ended.setdefault(id(self.step_log), threading.Event()).set()
                m.setattr(updater_module.Updater, "_host_job", host_job)
                m.setattr(updater_module.Updater, "pass_queued", pass_queued)
            reports = run(engine, batches)
            engine.drain()
        runs[threaded] = [t.clone() for c in range(len(store.master))
                          for t in (store.master[c], store.exp_avg[c], store.exp_avg_sq[c])]
        assert_run_matches(engine, reports, ref, ref_out)
        if threaded:
            assert engine.rt.updater.worker is not None and len(order) == len(batches)
            for step in order.values():
                assert sorted(step) == host and step[1:] == sorted(step[1:]), step
    if clip is None:
        assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))


def test_the_plan_prices_the_updates_left_at_the_end_in_the_forwards_order():
    """planning/host_adam.py, four host chunks of one second of compute each way and 1.5 s of host Adam each: backward
    hands chunk 3's gradient over at 5 s and chunk 0's at 8 s, when the compute ends with chunks 1 and 0 not started.
    In the forward's order chunk 0 is done 1.5 s into the next forward, which reads it first, and chunk 1 at 3.0 s,
    read 1 s in: the forward stalls 2.0 s (in backward's order it would wait at chunk 0 for all 3.0 s of them)."""
    from types import SimpleNamespace

    from pstar_fx.planning.host_adam import _host_adam_pipeline
    n = 1_000_000
    layout = SimpleNamespace(chunks=[SimpleNamespace(used_elems=n)] * 4)
    reads = [{0}, {1}, {2}, {3}, {3}, {2}, {1}, {0}]
    adam_at = {3: 4, 2: 5, 1: 6, 0: 7}
    buffers, exposed, hidden = _host_adam_pipeline(["host"] * 4, layout, [1.0] * 8, reads, adam_at, n / 1.5, True,
                                                   None, buffers=4)
    assert (buffers, hidden) == (4, 0.0) and exposed == pytest.approx(2.0, abs=1e-12)


def test_forward_order_off_keeps_the_order_queued(monkeypatch):
    monkeypatch.setenv("PSTAR_FX_FORWARD_ORDER", "0")
    q = Queued()
    for c in (5, 4, 3):
        q.update(c)
        q.landed[c] = True
    q.worker.close_pass()
    assert q.release() == ["5", "4", "3"]


def test_a_chunk_queued_twice_in_one_ended_pass_keeps_its_order():
    """(A pass that failed before it ended leaves its updates unmarked; the next pass's end marks them with its own.)
    The worker never takes a chunk's later job before its earlier one."""
    q = Queued()
    q.update(4, "a")
    q.update(3, "a")
    q.update(4, "b")
    q.update(2, "b")
    q.worker.close_pass()
    q.landed.update({2: True, 3: True, 4: True})
    order = q.release()
    assert order.index("4a") < order.index("4b") and order[:2] == ["3a", "4a"], order
