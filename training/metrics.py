"""A run's metrics (docs/design.md#training): ``OUT/metrics.csv``, one row per optimizer step (eval columns on eval
steps), and ``OUT/loss.png`` drawn from it (matplotlib Agg).
"""
from __future__ import annotations

import contextlib
import csv
import os
from pathlib import Path

METRIC_FIELDS = ["step", "epoch", "loss", "ce", "kl", "certainty", "align", "lr", "grad_norm", "tokens",
                 "tokens_per_s",
                 "forward_tokens_per_s", "elapsed_s", "eval_loss", "eval_acc", "accepted", "eval_accepted"]


class MetricsLog:
    """``OUT/metrics.csv`` of the main process (other processes write nothing).

    A resumed run keeps the rows up to its step (later rows were the steps it recomputes)."""

    def __init__(self, out: Path, step: int, main: bool):
        self.path = out / "metrics.csv"
        self.main = main
        if not main:
            return
        rows = []
        if self.path.is_file() and step > 0:
            rows = [r for r in csv.DictReader(open(self.path)) if int(r["step"]) <= step]
        with open(self.path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=METRIC_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def log(self, row: dict) -> None:
        """Append one step's row (missing columns empty)."""
        if not self.main:
            return
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=METRIC_FIELDS).writerow({k: row.get(k, "") for k in METRIC_FIELDS})

    def plot(self, png_path: Path) -> None:
        """Redraw the loss curve; a plotting failure never stops the run."""
        if self.main and self.path.is_file():
            with contextlib.suppress(Exception):
                plot_metrics(self.path, png_path)


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Loss curve (train loss per step, eval loss where measured) as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    ev = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r.get("eval_loss")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, label="train loss", lw=1)
    if ev:
        ax.plot([s for s, _ in ev], [v for _, v in ev], "o-", label="eval loss (t grid)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked-diffusion loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path.with_name(png_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
