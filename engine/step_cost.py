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
  rows) and fits ``step = a + b x rows + c x sequences``; ``c / b`` is this term. On the 2-core CPU it is not above
  zero (8 sequences of 8 rows step no slower than one of 64; ``benchmarks/results/bench_step_cost.json``), so it is
  0 here: what made "four sequences of 32 rows cost ~3x one of 128" was the rows themselves, a self-speculative
  sequence at draft block 32 forwarding up to 160 rows counted as 32. The term stays in the rule for hardware where
  it is not 0 (a GPU's per-sequence launches).

The cost depends on the sequence alone (never on who else is in the batch), so a step's selection by cost keeps every
sequence's tokens unchanged (batch invariance, docs/design.md#decisions).
"""
from __future__ import annotations

#: row-equivalents a lane costs beyond its rows: c / b of benchmarks/results/bench_step_cost.json (2 threads), <= 0
SEQUENCE_ROWS = 0


def step_rows(seq) -> int:
    """Rows ``seq`` (a :class:`~unmask.engine.request.Request`) forwards in a denoising step at most, all lanes."""
    plan = seq.plan
    if plan.speculative:
        return int(plan.draft_block) * (2 + int(plan.branches)) * len(seq.lanes)
    return seq.block_size * len(seq.lanes)


def step_cost(seq) -> int:
    """Row-equivalents ``seq`` costs a denoising step: :func:`step_rows` + :data:`SEQUENCE_ROWS` per lane."""
    return step_rows(seq) + SEQUENCE_ROWS * len(seq.lanes)
