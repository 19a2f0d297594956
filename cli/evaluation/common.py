"""Helpers the evaluation harness shares with the speed benchmarks (``benchmarks/bench_common.py`` re-exports them):
generated tokens cut at EOS, and the two-panel figure the quality and methods plots are drawn on."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def cut_at_eos(ids: list[int], eos_ids) -> list[int]:
    """``ids`` up to and including the first EOS id (generated tokens are counted that way:
    docs/design.md#decisions)."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def save_figure(fig, path) -> None:
    """Lay out and write a matplotlib figure the way every benchmark plot is written (PNG, 100 dpi)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def two_panels(figsize: tuple[float, float]):
    """``(fig, axes)``: two side-by-side panels on matplotlib's Agg backend (the quality and methods plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=figsize)


def write_panels(fig, axes, path: Path, xlabel: str, title: str, legend_fontsize: int = 8, dpi: int = 110) -> None:
    """Finish :func:`two_panels`' figure (the x label and a grid on each panel, the legend on the first, a title)
    and write it to ``path`` atomically (a temporary file renamed); closes the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=legend_fontsize)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)


def script_error(script: str, exc: Exception) -> int:
    """``script: error: <exc>`` on stderr; the exit status 2 of a refused run."""
    print(f"{script}: error: {exc}", file=sys.stderr)
    return 2
