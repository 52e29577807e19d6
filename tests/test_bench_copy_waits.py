"""bench/copy_waits.py on a made-up chrome trace: each idle stretch of the compute stream that a host-to-device copy
ends is put down to the cause the copy's own times give (asked for late, behind its stream, waiting for an event),
and the thread that queued it is named."""
import json

from bench_modules import load

copy_waits = load("copy_waits", "bench_copy_waits")

MAIN, WORKER = 101, 102          # CPU threads
COMPUTE, COPY, COPY2 = 7, 20, 21  # CUDA streams


def x(name, cat, ts, dur, tid, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def h2d(ts, dur, corr, stream=COPY):
    return x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", ts, dur, stream, correlation=corr, bytes=4096)


def launch(ts, corr, tid=MAIN):
    return x("cudaMemcpyAsync", "cuda_runtime", ts, 5, tid, correlation=corr)


def made_up_trace():
    ev = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": WORKER, "args": {"name": "pstar_fx-adam_0"}},
          x("bench.step0", "user_annotation", 0, 11000, MAIN)]
    ev += [x("gemm", "kernel", ts, dur, COMPUTE) for ts, dur in
           ((0, 1000), (2000, 1000), (4000, 1000), (6000, 1000), (8000, 500), (9500, 100), (10000, 100))]
    ev += [launch(1480, 1), h2d(1500, 500, 1)]                 # 1000-2000: asked for at 1485, ran at once
    ev += [h2d(2500, 1000, 90), launch(90, 2), h2d(3500, 500, 2)]     # 3000-4000: behind the copy before it
    ev += [launch(200, 3, tid=WORKER), h2d(5600, 400, 3, COPY2)]      # 5000-6000: queued early, waited for an event
    # 7000-8000: nothing ends it; 8500-9500: a cast on the copy stream after a copy asked for late (fp32 pieces)
    ev += [launch(8990, 4), h2d(9000, 400, 4), x("cast", "kernel", 9400, 100, COPY)]
    ev += [x("gemm", "kernel", 9700, 50, COPY)]               # (a 0.3 ms stretch: 9600-10000, no copy lands)
    ev += [x("pstar_fx.host_job c12", "user_annotation", 100, 4000, WORKER),
           x("pstar_fx.host_job c13", "user_annotation", 4100, 1000, WORKER),
           x("pstar_fx.wait_for_host_adam", "user_annotation", 4200, 800, MAIN),
           x("pstar_fx.wait_for_host_adam", "user_annotation", 5200, 200, MAIN)]
    return {"traceEvents": ev}


def test_each_stretch_by_cause(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(made_up_trace()))
    report = copy_waits.analyze(copy_waits.load(str(path)), min_gap_ms=0.3)
    assert report["compute_stream"] == COMPUTE
    (step,) = report["steps"]
    assert step["wall_ms"] == 11.0
    assert step["idle_by_cause_ms"] == {"queued late": 2.0, "behind its stream": 1.0, "waited for an event": 1.0,
                                        "no copy ends it": 1.4}
    assert step["idle_by_launcher_ms"] == {"launching thread": 3.0, "pstar_fx-adam_0": 1.0}
    by_at = {s["at_ms"]: s for s in step["stretches"]}
    assert by_at[1.0]["cause"] == "queued late" and by_at[1.0]["launched_at_ms"] == 1.485
    assert by_at[3.0]["cause"] == "behind its stream" and by_at[3.0]["run_ms"] == 1.5
    assert by_at[5.0]["launched_by"] == "pstar_fx-adam_0" and by_at[5.0]["started_at_ms"] == 5.6
    assert by_at[8.5]["cause"] == "queued late" and by_at[8.5]["bytes"] == 4096
    assert step["host_jobs"] == [{"chunk": "c12", "from_ms": 0.1, "to_ms": 4.1},
                                 {"chunk": "c13", "from_ms": 4.1, "to_ms": 5.1}]
    assert step["launcher_waits_ms"] == {"wait_for_host_adam": 1.0}
    # the cast after the 9000-9400 copy started at once; the 9700 kernel on the copy stream follows a kernel
    assert step["copy_stream_kernel_waits"]["count"] == 0


def test_a_cast_that_waits_beside_a_compute_kernel(tmp_path):
    ev = [x("bench.step0", "user_annotation", 0, 3000, MAIN), x("gemm_big", "kernel", 0, 2000, COMPUTE),
          x("gemm", "kernel", 2410, 100, COMPUTE), launch(10, 1), h2d(20, 300, 1),
          x("cast", "kernel", 2000, 50, COPY), launch(30, 2), h2d(2050, 300, 2), x("cast", "kernel", 2350, 50, COPY)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    (step,) = copy_waits.analyze(copy_waits.load(str(path)))["steps"]
    assert step["copy_stream_kernel_waits"] == {"count": 1, "ms": 1.68, "longest_ms": 1.68,
                                                "beside": {"gemm_big": 1.68}}
    # the compute stream's wait (2000-2410 us) ends as the second piece's cast lands: that piece's copy ran behind
    # the first cast, which waited beside gemm_big
    (stretch,) = step["stretches"]
    assert stretch["ms"] == 0.41 and stretch["cause"] == "behind its stream" and stretch["started_at_ms"] == 2.05


def test_report_prints_each_stretch(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(made_up_trace()))
    copy_waits.print_report(copy_waits.analyze(copy_waits.load(str(path))))
    out = capsys.readouterr().out
    assert "queued by pstar_fx-adam_0" in out and "began waited for an event" in out
    assert "host jobs: 2, 5.0 ms, from 0.1 to 5.1 ms: c12@0-4 c13@4-5" in out
