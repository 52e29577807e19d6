"""report: `pstar-fx train --report-to tensorboard|wandb|none` — each step's record, the one --metrics writes as a
JSONL line, sent to TensorBoard or Weights & Biases under the same keys, at the same step number.

Both are optional (pip install pstar_fx[loggers]). TensorBoard writes event files through torch's SummaryWriter
into --log-dir (default runs/<date>_<host>); wandb starts a run in project "pstar-fx" in --log-dir/wandb (default
$WANDB_DIR or ./wandb), online or offline as wandb is set (WANDB_MODE=offline needs no network: `wandb sync` uploads
the run later). Only rank 0 reports, as only rank 0 writes --metrics.
"""
from __future__ import annotations

import argparse

REPORTERS = ("tensorboard", "wandb")


def report_to(value: str) -> tuple[str, ...]:
    """argparse type of --report-to: "none", or names of REPORTERS separated by commas."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["none"]:
        return ()
    bad = [n for n in names if n not in REPORTERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: expected 'none' or one or more of {', '.join(REPORTERS)} "
                                         "separated by commas")
    return tuple(dict.fromkeys(names))


def scalars(record: dict) -> dict[str, float]:
    """A record's values as numbers, its step left out (the x axis); a value that is None (no grad norm) is not
    reported."""
    return {k: float(v) for k, v in record.items() if k != "step" and v is not None}


class TensorBoard:
    def __init__(self, log_dir: str | None, run_config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("--report-to tensorboard needs the tensorboard package: pip install "
                              "'pstar_fx[loggers]'") from e
        self.writer = SummaryWriter(log_dir=log_dir)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in run_config.items()))

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, log_dir: str | None, run_config: dict):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("--report-to wandb needs the wandb package: pip install 'pstar_fx[loggers]'") from e
        self.run = wandb.init(project="pstar-fx", dir=log_dir, config=run_config)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Reporters:
    """The reporters --report-to names, fed each step's record; `close` ends them (a wandb run finishes)."""

    def __init__(self, names: tuple[str, ...], log_dir: str | None, run_config: dict):
        self.open = []
        try:
            for name in names:
                self.open.append({"tensorboard": TensorBoard, "wandb": Wandb}[name](log_dir, run_config))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        for r in self.open:
            r.log(record)

    def close(self) -> None:
        for r in self.open:
            r.close()
        self.open = []
