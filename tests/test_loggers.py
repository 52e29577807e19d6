"""`pstar-fx train --report-to tensorboard,wandb`: a TensorBoard event file and an offline wandb run hold each step's
--metrics record under the same keys and steps, read back from the files."""
import glob
import json
import struct

import pytest

from pstar_fx.cli import main

KEYS = ("loss", "lr", "grad_norm", "clip_coef", "skipped", "tokens_per_s", "tflops", "seconds", "device_peak_bytes",
        "host_peak_bytes")


def _wandb_history(path: str) -> list[dict]:
    """The history rows of an offline wandb run file (run-ID.wandb): a ":W&B" header of 7 bytes, then LevelDB log
    records (a 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST) in 32 KiB blocks, each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2
    block = 32768
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:                  # a block's zero-padded tail
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                         # FULL, or the LAST piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_report_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[loggers]')")
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[loggers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    logs = tmp_path / "logs"
    try:
        assert main(["train", "--model", "tiny", "--steps", "2", "--seq", "32", "--eval-every", "2", "--device", "cpu",
                     "--report-to", "tensorboard,wandb", "--log-dir", str(logs),
                     "--metrics", str(tmp_path / "m.jsonl")]) == 0
    finally:
        wandb.teardown()                           # the wandb service process ends with the test
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "eval_loss" in records[1]

    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(KEYS) | {"eval_loss"}
    for key in (*KEYS, "eval_loss"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = {r["step"]: float(r[key]) for r in records if key in r}
        assert logged.keys() == expected.keys(), key
        for step, value in expected.items():      # an event holds a float32
            assert logged[step] == pytest.approx(value, rel=2**-23), (key, step)

    runs = glob.glob(str(logs / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    history = _wandb_history(runs[0])
    assert [h["_step"] for h in history] == [1, 2]
    for h, r in zip(history, records):
        assert {k: h[k] for k in r if k != "step"} == {k: float(v) for k, v in r.items() if k != "step"}


def test_report_to_names_the_valid_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--report-to", "mlflow"])
    assert e.value.code == 2
    assert "expected 'none' or one or more of tensorboard, wandb" in capsys.readouterr().err
