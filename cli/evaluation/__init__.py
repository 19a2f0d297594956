"""The evaluation harness behind ``unmask eval``, shipped in the package so that the command works from an
installed wheel as well as from a source checkout (docs/design.md#measuring):

* :mod:`.quality` -- the harness: options, the AR parent's and the diffusion models' runs, scoring, the report;
* :mod:`.metrics` -- the quality measures (exact match, token F1, repetition, generative perplexity);
* :mod:`.common` -- the helpers it shares with the speed benchmarks (``benchmarks/bench_common.py`` re-exports
  them): cutting at EOS, the two-panel figure;
* ``data/`` -- in a wheel only: the held-out prompts and the grid ids (``benchmarks/data`` of the checkout).

``benchmarks/eval_quality.py`` and ``benchmarks/quality_metrics.py`` are thin scripts over these modules.
"""
