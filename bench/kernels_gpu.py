"""GPU kernel check and benchmark: pstar_fx's Triton Adam and cast against torch on CUDA, and the C++
CPU Adam against torch's fused CPU AdamW. Standalone; meant for the H200 machine.

    pip install --no-build-isolation --no-deps -e .     # builds pstar_fx.kernels._cpu_adam there
    python bench/kernels_gpu.py                          # ~1-2 min; prints a table and one line
                                                         #   KERNELS {json}
    python bench/kernels_gpu.py --gpu-params 100e6 --cpu-params 50e6 --reps 5    # quicker

What it measures (bytes per element each kernel must move; see the kernel files):
  1. correctness on CUDA: Triton AdamW/Adam vs torch.optim.AdamW/Adam (fp32/bf16/fp16 grads, bf16
     param copy, loss scale), non-finite grads leave every buffer bit-unchanged, cast fp32->bf16/fp16
     bit-exact vs torch (NaN stays NaN), sq_norm vs float64; the C++ Adam vs torch on the CPU.
  2. Triton AdamW vs torch.optim.AdamW(fused=True) on --gpu-params fp32 params (default 500M):
     G params/s and TB/s. Triton variants: fp32 grads with the non-finite pre-pass (32 B/param) and
     without (28 B), bf16 grads + bf16 param copy (30 B); fused torch moves 28 B and has no check.
     The contract's bool return costs one device->host sync per call, timed separately; the
     found_inf variant (no sync) is what a runtime would use.
  3. cast fp32->bf16 / fp16 (6 B/elem) in GB/s against the device copy bandwidth (fp32 copy_, 8 B/elem)
     and against torch's own .copy_ conversion.
  4. C++ Adam, bf16 grads + bf16 param copy (30 B/param with the check), vs torch AdamW(fused=True) on
     the CPU with fp32 grads (28 B/param), --cpu-params params (default 200M), all cores.

Timing: CUDA events around each call after warm-up, the median of --reps; CPU: perf_counter, median.
Each item is wrapped: a failure is reported in the table and the JSON and the rest still runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

os.environ["TRITON_INTERPRET"] = "0"  # real kernels, even if the shell exported the CI setting

import torch  # noqa: E402

RESULTS: dict = {"checks": {}, "timings": {}, "errors": {}}
ROWS: list[tuple[str, str, str, str]] = []  # (item, time, rate, note)


def item(name):
    """Decorator: run one check/benchmark, record an error instead of stopping."""
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - report and go on
                RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
                ROWS.append((name, "FAILED", "", f"{type(e).__name__}: {str(e)[:90]}"))
                traceback.print_exc()
            finally:
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                print(f"[{name}] {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        return run
    return wrap


def cuda_median_s(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cpu_median_s(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def record(key, seconds, elems, bytes_per_elem, note=""):
    gps = elems / seconds / 1e9
    tbps = bytes_per_elem * elems / seconds / 1e12
    RESULTS["timings"][key] = dict(ms=round(seconds * 1e3, 4), G_elems_per_s=round(gps, 3),
                                   TB_per_s=round(tbps, 4), bytes_per_elem=bytes_per_elem, elems=int(elems))
    ROWS.append((key, f"{seconds * 1e3:9.3f} ms", f"{gps:8.2f} G/s {tbps * 1e3:8.1f} GB/s", note))


# ------------------------------------------------------------------------------------ correctness

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _reference(p0, grads, wd, decoupled, scale):
    param = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=wd,
              foreach=False)
    for g in grads:
        param.grad = g.float() / scale
        opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


def _check_adam(backend, device, n=1_000_003):
    from pstar_fx.kernels import adam_step

    worst = {}
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for decoupled, scale in ((True, 1.0), (False, 1024.0), (True, 3.0)):
            gen = torch.Generator().manual_seed(0)
            p0 = torch.randn(n, generator=gen).to(device)
            grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype).to(device) for _ in range(3)]
            p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
            out = torch.empty(n, dtype=torch.bfloat16, device=device)
            for t, g in enumerate(grads, start=1):
                scaled = (g.float() * scale).to(grad_dtype)
                assert adam_step(p, scaled, m, v, step=t, weight_decay=0.1, grad_scale=scale, param_out=out,
                                 decoupled_weight_decay=decoupled, backend=backend, **HYPER) is True
            rp, rm, rv = _reference(p0, [(g.float() * scale).to(grad_dtype) for g in grads], 0.1, decoupled, scale)
            key = f"{str(grad_dtype)[6:]}/{'adamw' if decoupled else 'adam'}/scale{scale:g}"
            errs = dict(p=(p - rp).abs().max().item(), m=(m - rm).abs().max().item(), v=(v - rv).abs().max().item())
            # Adam's L2 term can cancel the grad (g + wd*p ~ 0: the step is then eps-dominated and
            # a 1-ulp difference in g + wd*p, e.g. FMA or not, moves p by up to ~1% of lr).
            torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-5 if decoupled else HYPER["lr"] / 50)
            torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-7 if decoupled else 1e-5)
            torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-10 if decoupled else 1e-8)
            assert torch.equal(out, p.bfloat16()), "param_out is not p rounded to bf16"
            worst[key] = max(errs.values())
    # non-finite grads: False and nothing written
    p, m, v = torch.randn(n, device=device), torch.rand(n, device=device), torch.rand(n, device=device)
    out = torch.zeros(n, dtype=torch.bfloat16, device=device)
    before = [t.clone() for t in (p, m, v, out)]
    for bad_at in (0, n // 2, n - 1):
        g = torch.randn(n, device=device)
        g[bad_at] = float("nan") if bad_at else float("inf")
        assert adam_step(p, g, m, v, step=5, weight_decay=0.1, param_out=out, backend=backend, **HYPER) is False
        assert all(torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32))
                   for a, b in zip((p, m, v, out), before)), "state changed on a non-finite grad"
    return worst


@item("check: Triton Adam on CUDA vs torch")
def check_triton_adam():
    RESULTS["checks"]["triton_adam_max_abs_err"] = _check_adam("triton", "cuda")
    ROWS.append(("check: Triton Adam on CUDA vs torch", "ok", "", "fp32/bf16/fp16 grads, L2+AdamW, scale, inf/NaN"))


@item("check: C++ Adam on CPU vs torch")
def check_cpp_adam():
    from pstar_fx.kernels import cpu_adam

    if not cpu_adam.available():
        raise RuntimeError(f"C++ extension not built: {cpu_adam.extension()}")
    RESULTS["checks"]["cpp_adam_max_abs_err"] = _check_adam("cpp", "cpu")
    ROWS.append(("check: C++ Adam on CPU vs torch", "ok", "", "fp32/bf16/fp16 grads, L2+AdamW, scale, inf/NaN"))


@item("check: Triton cast + sq_norm on CUDA")
def check_triton_cast():
    from pstar_fx.kernels import cast_, sq_norm

    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (4_000_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x[~torch.isnan(x)], torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e-45, float("inf")])]).cuda()
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(x.shape, dtype=dtype, device="cuda")
        cast_(dst, x, backend="triton")
        mism = (dst.view(torch.int16) != x.to(dtype).view(torch.int16)).sum().item()
        assert mism == 0, f"{mism} elements differ from torch's {dtype} cast"
        nan = torch.full((1000,), float("nan"), device="cuda")
        d2 = torch.empty(1000, dtype=dtype, device="cuda")
        cast_(d2, nan, backend="triton")
        assert bool(torch.isnan(d2.float()).all()), "NaN did not stay NaN"
    y = torch.randn(10_000_019, device="cuda") * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = sq_norm(y.to(dtype), backend="triton").item()
        ref = y.to(dtype).double().square().sum().item()
        assert abs(got - ref) <= 1e-5 * ref, f"sq_norm {dtype}: {got} vs {ref}"
    RESULTS["checks"]["triton_cast_bit_exact"] = True
    ROWS.append(("check: Triton cast + sq_norm on CUDA", "ok", "", "bit-exact vs torch incl. inf/subnormal; NaN->NaN"))


# ------------------------------------------------------------------------------------ GPU timings


@item("GPU AdamW")
def bench_gpu_adam(n, reps):
    from pstar_fx.kernels import adam_step

    p, g, m, v = (torch.randn(n, device="cuda") * s for s in (1.0, 1e-2, 1e-3, 1e-3))
    v.abs_()
    g16 = g.bfloat16()
    out16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    kw = dict(step=10, weight_decay=0.01, **{**HYPER, "lr": 1e-4})
    variants = {
        "triton AdamW fp32 grads, check, found_inf (no sync)": (
            lambda: adam_step(p, g, m, v, found_inf=found_inf, backend="triton", **kw), 32),
        "triton AdamW fp32 grads, no check": (
            lambda: adam_step(p, g, m, v, check_finite=False, found_inf=found_inf, backend="triton", **kw), 28),
        "triton AdamW fp32 grads, check, -> bool (1 sync)": (
            lambda: adam_step(p, g, m, v, backend="triton", **kw), 32),
        "triton AdamW bf16 grads + bf16 copy, check, no sync": (
            lambda: adam_step(p, g16, m, v, param_out=out16, found_inf=found_inf, backend="triton", **kw), 30),
    }
    for name, (fn, nbytes) in variants.items():
        record(name, cuda_median_s(fn, reps), n, nbytes)
    del g16, out16
    # torch fused AdamW on its own copy of the same problem
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    del p, m, v
    torch.cuda.empty_cache()
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    record("torch AdamW(fused=True) fp32 grads", cuda_median_s(opt.step, reps), n, 28, "reference")


@item("GPU Triton Adam block sweep")
def bench_gpu_adam_blocks(n, reps):
    from pstar_fx.kernels import triton_adam

    p, g, m, v = (torch.randn(n, device="cuda") * s for s in (1.0, 1e-2, 1e-3, 1e-3))
    v.abs_()
    found_inf = torch.zeros(1, device="cuda")
    sweep = {}
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (8192, 16)):
        fn = lambda: triton_adam.adam_step(  # noqa: E731
            p, g, m, v, step=10, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=1.0,
            param_out=None, decoupled_weight_decay=True, check_finite=False, found_inf=found_inf, block=block,
            num_warps=warps)
        sweep[f"{block}/{warps}"] = round(n / cuda_median_s(fn, reps) / 1e9, 2)
    RESULTS["timings"]["triton_adam_block_sweep_G_per_s (BLOCK/num_warps, no check)"] = sweep
    ROWS.append(("triton Adam BLOCK/num_warps sweep", "", "", json.dumps(sweep)))


@item("GPU cast")
def bench_gpu_cast(n, reps):
    from pstar_fx.kernels import cast_

    src = torch.randn(n, device="cuda")
    dst32 = torch.empty(n, device="cuda")
    record("device copy fp32 (copy_)", cuda_median_s(lambda: dst32.copy_(src), reps), n, 8, "bandwidth reference")
    copy_tbps = RESULTS["timings"]["device copy fp32 (copy_)"]["TB_per_s"]
    del dst32
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(n, dtype=dtype, device="cuda")
        name = str(dtype)[6:]
        record(f"triton cast fp32->{name}", cuda_median_s(lambda: cast_(dst, src, backend="triton"), reps), n, 6)
        rt = RESULTS["timings"][f"triton cast fp32->{name}"]["TB_per_s"]
        ROWS[-1] = ROWS[-1][:3] + (f"{rt / copy_tbps:.0%} of copy bandwidth",)
        record(f"torch copy_ fp32->{name}", cuda_median_s(lambda: dst.copy_(src), reps), n, 6)
    g = torch.randn(n, device="cuda")
    from pstar_fx.kernels import sq_norm

    record("triton sq_norm fp32", cuda_median_s(lambda: sq_norm(g, backend="triton"), reps), n, 4)
    record("torch sq (vector_norm**2) fp32",
           cuda_median_s(lambda: torch.linalg.vector_norm(g).square(), reps), n, 4)


# ------------------------------------------------------------------------------------ CPU timings


@item("CPU Adam")
def bench_cpu_adam(n, reps):
    from pstar_fx.kernels import adam_step, cpu_adam

    if not cpu_adam.available():
        raise RuntimeError(f"C++ extension not built: {cpu_adam.extension()}")
    RESULTS["cpu_threads"] = dict(torch=torch.get_num_threads(), os=os.cpu_count())
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen)
    g16 = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    kw = dict(step=10, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, backend="cpp")
    record("C++ Adam bf16 grads + bf16 copy, check",
           cpu_median_s(lambda: adam_step(p, g16, m, v, param_out=out16, **kw), reps), n, 30)
    record("C++ Adam bf16 grads + bf16 copy, no check",
           cpu_median_s(lambda: adam_step(p, g16, m, v, param_out=out16, check_finite=False, **kw), reps), n, 28)
    del g16, out16
    g = torch.randn(n, generator=gen) * 1e-2
    record("C++ Adam fp32 grads, check", cpu_median_s(lambda: adam_step(p, g, m, v, **kw), reps), n, 32)
    del m, v
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    record("torch AdamW(fused=True) CPU fp32 grads", cpu_median_s(opt.step, reps), n, 28, "reference")
    del opt
    dst = torch.empty(n, dtype=torch.bfloat16)
    from pstar_fx.kernels import cast_

    record("C++ cast fp32->bf16", cpu_median_s(lambda: cast_(dst, g, backend="cpp"), reps), n, 6)
    record("torch copy_ fp32->bf16 CPU", cpu_median_s(lambda: dst.copy_(g), reps), n, 6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-params", type=float, default=500e6)
    ap.add_argument("--cpu-params", type=float, default=200e6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    n_gpu, n_cpu = int(args.gpu_params), int(args.cpu_params)

    import pstar_fx.kernels as K

    RESULTS["env"] = dict(python=platform.python_version(), torch=torch.__version__,
                          cuda=torch.version.cuda, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                          cpu_count=os.cpu_count(), build_info=K.build_info())
    try:
        import triton

        RESULTS["env"]["triton"] = triton.__version__
    except ImportError as e:
        RESULTS["env"]["triton"] = f"missing: {e}"

    if torch.cuda.is_available():
        check_triton_adam()
        check_triton_cast()
        bench_gpu_adam(n_gpu, args.reps)
        bench_gpu_adam_blocks(min(n_gpu, 200_000_000), args.reps)
        bench_gpu_cast(n_gpu, args.reps)
    else:
        RESULTS["errors"]["cuda"] = "no CUDA device: GPU items skipped"
        ROWS.append(("GPU items", "SKIPPED", "", "no CUDA device"))
    check_cpp_adam()
    if not args.skip_cpu:
        bench_cpu_adam(n_cpu, max(3, args.reps // 2))

    t = RESULTS["timings"]
    ratios = {}
    for mine, ref in (("triton AdamW fp32 grads, check, found_inf (no sync)", "torch AdamW(fused=True) fp32 grads"),
                      ("triton AdamW fp32 grads, no check", "torch AdamW(fused=True) fp32 grads"),
                      ("C++ Adam bf16 grads + bf16 copy, check", "torch AdamW(fused=True) CPU fp32 grads"),
                      ("C++ Adam fp32 grads, check", "torch AdamW(fused=True) CPU fp32 grads")):
        if mine in t and ref in t:
            ratios[f"{mine} / {ref}"] = round(t[mine]["G_elems_per_s"] / t[ref]["G_elems_per_s"], 3)
    RESULTS["speedups_vs_torch"] = ratios

    env = RESULTS["env"]
    print(f"\npstar_fx kernels on {env['gpu']} | torch {env['torch']} | triton {env.get('triton')} | "
          f"{env['cpu_count']} CPUs, torch threads {torch.get_num_threads()} | "
          f"cpu_adam simd {((env['build_info'] or {}).get('cpu_adam') or {}).get('simd')}")
    width = max(len(r[0]) for r in ROWS) + 2
    print(f"{'item':<{width}}{'time':>13}  {'throughput':<28}note")
    print("-" * (width + 60))
    for name, tm, rate, note in ROWS:
        print(f"{name:<{width}}{tm:>13}  {rate:<28}{note}")
    for k, r in ratios.items():
        print(f"speedup {k}: {r:.2f}x")
    print("KERNELS " + json.dumps(RESULTS, default=str))
    return 1 if RESULTS["errors"] and any(k != "cuda" for k in RESULTS["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
