"""Quality/speed evaluation of diffusion checkpoints against their AR parent: a thin script over
:mod:`unmask.cli.evaluation.quality`, the harness ``unmask eval`` runs (it ships in the package, so the command works
from an installed wheel; docs/design.md#measuring). Options and what a run writes: ``unmask eval --help``.

Usage::

    python benchmarks/eval_quality.py --quick     # 12 prompts, 2 settings
    python benchmarks/eval_quality.py             # full grid + full held-out set

``import eval_quality`` (with ``benchmarks/`` on ``sys.path``, as the other benchmarks and the tests do) gives the
harness module itself, so setting one of its attributes changes what the harness sees.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unmask.cli.evaluation import quality  # noqa: E402

if __name__ == "__main__":
    import bench_common as bc

    bc.run_script(quality.main)
else:
    sys.modules[__name__] = quality
