"""bench/box_limits.py on CPU: the record of the box's limits (issue 27) has its version, says what machine it
describes, carries every host figure it can measure here and names each figure it cannot with the reason (no
CUDA device on the test machine: the copies, the device's memory and matmul)."""
import json

import torch
from bench_modules import load

from pstar_fx.kernels import cpu_adam

bench = load("box_limits", "bench_box_limits")


def test_the_record_has_every_limit_measured_or_said_missing(tmp_path):
    out = tmp_path / "limits.json"
    assert bench.main(["--elems", "1M", "--rounds", "1", "--copy-bytes", "1M", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["version"] == bench.VERSION == 1
    assert r["box"]["cpus"] and r["box"]["torch"] == torch.__version__
    device = ["h2d_gb_s", "d2h_gb_s", "both_ways_h2d_gb_s", "both_ways_d2h_gb_s", "device_copy_gb_s",
              "matmul_tflops"]
    host = ["host_triad_gb_s", "host_adam_gparams_s"]
    for k in device + host:
        assert (k in r["limits"]) != (k in r["missing"]), k          # measured, or said why not: never both
    if not torch.cuda.is_available():
        assert all(r["missing"][k] == "no CUDA device" for k in device)
    if cpu_adam.available():
        assert r["limits"]["host_triad_gb_s"] > 0
        assert set(r["limits"]["host_adam_gparams_s"]) == {"fp32", "bf16"}
        assert all(v > 0 for v in r["limits"]["host_adam_gparams_s"].values())
    rates = r["rates"]                                                 # the planner's calibration, afresh
    assert rates["flops"] > 0 and rates["mem_bw"] > 0 and rates["host_adam"] > 0
