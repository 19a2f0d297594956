"""Choices admitted together into an unbounded KV pool hold runs of one slab (engine/scheduler.py
``_grow_pool_for_burst``), evenly spaced: the lane attention's one call per layer for alike lanes."""
import tiny

from unmask.engine import LLM, SamplingParams


def test_a_burst_of_choices_lands_in_one_slab():
    llm = LLM(tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4), max_batch_size=16)
    engine = llm._engine(16)
    p = SamplingParams.from_flat(speculative=False, cache="prefix", max_tokens=8, block_size=4, temperature=0)
    ids = llm.tokenizer("the quick brown fox").input_ids
    seqs = [s for i in range(12) for s in engine.add_request(ids, p, f"b{i}")]
    engine.step()
    pool = engine.scheduler.kv_pool
    assert pool.capacity_blocks is None
    runs = [pool.runs(s.lanes[0].cache.table, s.length) for s in seqs]
    assert all(len(r) == 1 for r in runs)  # each lane one run ...
    assert len({id(r[0][0]) for r in runs}) == 1  # ... all in one slab (was 1, 1, 2, 4, 4 slabs as it doubled)
    starts = sorted(r[0][1] for r in runs)
    assert len({b - a for a, b in zip(starts, starts[1:])}) == 1  # evenly spaced
    while engine.has_unfinished():
        engine.step()
