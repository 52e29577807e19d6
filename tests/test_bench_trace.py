"""bench/trace_summary.py on a made-up chrome trace: two steps, the compute stream and a copy stream, the launching
thread's annotations; what it says about each step is checked against the trace's own arithmetic."""
import gzip
import json

from bench_modules import load

trace_summary = load("trace_summary", "bench_trace_summary")

MAIN, WORKER = 101, 102          # CPU threads
COMPUTE, COPY = 7, 25            # CUDA streams


def x(name, cat, ts, dur, tid, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def made_up_trace():
    ev = [
        # step 0: 0..1000 us; kernels 0-300 and 500-900 on the compute stream (a 200 us gap while the launcher is
        # inside pstar_fx.correct), a copy 300-700 on another stream
        x("bench.step0", "user_annotation", 0, 1000, MAIN),
        x("pstar_fx.pass", "user_annotation", 0, 280, MAIN),
        x("pstar_fx.correct", "user_annotation", 290, 200, MAIN),
        x("aten::mm", "cpu_op", 300, 50, MAIN),
        x("cudaStreamSynchronize", "cuda_runtime", 920, 70, MAIN),
        x("gemm_a", "kernel", 0, 300, COMPUTE),
        x("gemm_b", "kernel", 500, 400, COMPUTE),
        x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 300, 400, COPY),
        # step 1: 1000..1500 us, one kernel, no gap; the worker thread's op is not the launcher's
        x("bench.step1", "user_annotation", 1000, 500, MAIN),
        x("adam", "cpu_op", 1000, 400, WORKER),
        x("gemm_c", "kernel", 1010, 480, COMPUTE),
    ]
    return {"traceEvents": ev + [{"ph": "M", "name": "process_name", "pid": 1}]}


def test_each_step_stream_by_stream(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(made_up_trace(), f)
    out = trace_summary.summarize(trace_summary.load(str(path)), min_gap_ms=0.1)
    assert out["compute_stream"] == COMPUTE
    s0, s1 = out["steps"]
    assert s0["step"] == "bench.step0" and s0["wall_ms"] == 1.0
    compute, copy = s0["streams"][str(COMPUTE)], s0["streams"][str(COPY)]
    assert compute["compute"] and compute["busy_ms"] == 0.7 and compute["kernels_ms"] == 0.7
    assert not copy["compute"] and copy["copies_ms"] == 0.4 and copy["first_ms"] == 0.3 and copy["last_ms"] == 0.7
    # the compute stream idled 300-500 us while the launcher was inside pstar_fx.correct (an aten op inside it)
    assert s0["compute_idle_ms"] == 0.2
    (gap,) = s0["gaps"]
    assert gap == {"at_ms": 0.3, "ms": 0.2, "after": "gemm_a", "before": "gemm_b", "launcher_in": "pstar_fx.correct"}
    assert s0["compute_lead_ms"] == 0.0 and s0["compute_tail_ms"] == 0.1
    assert s0["annotations_ms"] == {"pstar_fx.correct": 0.2, "pstar_fx.pass": 0.28}
    assert s0["launcher_cuda_calls_ms"] == {"cudaStreamSynchronize": 0.07}
    assert s1["streams"][str(COMPUTE)]["busy_ms"] == 0.48 and s1["gaps"] == [] and s1["compute_lead_ms"] == 0.01
    assert str(COPY) not in s1["streams"]
