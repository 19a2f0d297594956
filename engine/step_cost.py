"""What one sequence costs a denoising step, in row-equivalents: the unit of ``--max-step-rows``
(docs/design.md#admission-and-limits).

A sequence's step cost is the rows it forwards plus a fixed term per lane for being a sequence at all:

* rows: plain diffusion forwards its block (``block_size``) per lane (2 lanes under CFG); a self-speculative step
  forwards up to ``1 + drafts + draft_block x (1 + branches)`` rows (``unmask.engine.speculative``: the final token,
  up to ``draft_block - 1`` drafts, mask group A and one fallback group per branch), i.e. at most
  ``draft_block x (2 + branches)``: 160 at draft block 32 with the default 3 branches, not 32;
* :data:`SEQUENCE_ROWS` per lane: what a lane costs beyond its rows (its own attention over its own cache, its KV
  gather and appends, its logits' sampling and its bookkeeping), measured on the default model:
  ``benchmarks/bench_step_cost.py`` times the same 64 rows in 1, 2, 4 and 8 sequences (and one sequence at 32 and 128
  rows) and fits ``step = a + b x rows + c x sequences``; ``c / b`` is this term: 21.6 ms against 12.1 ms a row on
  the 2-core CPU (the least of 7 rounds; ``benchmarks/results/bench_step_cost.json``), so 2 rows. It is small: what
  made "four sequences of 32 rows cost ~3x one of 128" was the rows themselves, a self-speculative sequence at draft
  block 32 forwarding up to 160 rows counted as 32.

The cost depends on the sequence alone (never on who else is in the batch), so a step's selection by cost keeps every
sequence's tokens unchanged (batch invariance, docs/design.md#decisions).
"""
from __future__ import annotations

#: row-equivalents a lane costs beyond its rows: c / b of benchmarks/results/bench_step_cost.json (2 threads)
SEQUENCE_ROWS = 2


def step_rows(seq) -> int:
    """Rows ``seq`` (a :class:`~unmask.engine.request.Request`) forwards in a denoising step at most, all lanes."""
    plan = seq.plan
    if plan.speculative:
        return int(plan.draft_block) * (2 + int(plan.branches)) * len(seq.lanes)
    return seq.block_size * len(seq.lanes)


def step_cost(seq) -> int:
    """Row-equivalents ``seq`` costs a denoising step: :func:`step_rows` + :data:`SEQUENCE_ROWS` per lane."""
    return step_rows(seq) + SEQUENCE_ROWS * len(seq.lanes)
