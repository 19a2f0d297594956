"""The quality measures of the evaluation (exact match, token F1, repetition, generative perplexity): a thin alias of
:mod:`unmask.cli.evaluation.metrics`, which ships in the package with the harness ``unmask eval`` runs.
``import quality_metrics`` (with ``benchmarks/`` on ``sys.path``) gives that module itself."""
from __future__ import annotations

import sys

from unmask.cli.evaluation import metrics

sys.modules[__name__] = metrics
