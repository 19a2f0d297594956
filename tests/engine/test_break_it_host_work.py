"""Break-it tests of issue 42's per-request host work (docs/design.md#decoding, "Per-request host work"): the block
and chunk metadata shared by every sequence of one canvas shape stay unchanged whatever decodes through them; a
request decodes the same alone, in a mixed batch, with the prefix cache on and off; the masked-position memo and the
stop-scan skip follow token editing and stop rules across blocks; the admission checks."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoding_paths as dp  # noqa: E402
import tiny  # noqa: E402

from unmask.engine import LLM, Constraint, SamplingParams  # noqa: E402
from unmask.engine import sequence as seq_mod  # noqa: E402
from unmask.engine.limits import ParamError  # noqa: E402
from unmask.engine.text_ids import check_token_ids  # noqa: E402

MIXED = [dict(temperature=0, block_size=4, multi_block=0.5),
         dict(temperature=0, block_size=4, speculative=True),
         dict(temperature=0, block_size=4, constraint=True, max_tokens=24),
         dict(temperature=0.6, seed=4, block_size=8, sub_block_size=4, cfg_scale=0.7),
         dict(temperature=0, block_size=4, threshold=0.2, stop=["a"], min_tokens=3),
         dict(temperature=0, block_size=4, max_tokens=6)]


def _snapshot(obj):
    return [t.clone() for t in obj if isinstance(t, torch.Tensor)]


@pytest.fixture
def shared_watch(monkeypatch):
    """Every block/chunk metadata object handed out while the test runs, with a copy taken when it was built."""
    seq_mod.block_metadata.cache_clear()
    seq_mod.chunk_metadata.cache_clear()
    seen = {}
    for name in ("block_metadata", "chunk_metadata"):
        orig = getattr(seq_mod, name)

        def wrapped(*a, _orig=orig):
            out = _orig(*a)
            seen.setdefault(id(out), (out, _snapshot(out)))
            return out

        wrapped.cache_clear = orig.cache_clear
        monkeypatch.setattr(seq_mod, name, wrapped)
    yield seen
    seq_mod.block_metadata.cache_clear()
    seq_mod.chunk_metadata.cache_clear()


def _run(model, reqs, prefix: bool, arrive_every: int = 1, prompt: int = 0) -> dict:
    llm = LLM(model, max_batch_size=8, enable_prefix_caching=prefix)
    engine = llm._engine(8)
    pending = []
    for i, kw in enumerate(reqs):
        kw = dict(kw)
        if kw.pop("constraint", None):
            kw["constraint"] = Constraint("json_schema", dp.SCHEMA)
        flat = dict({"speculative": False, "max_tokens": 10, "ignore_eos": "constraint" not in kw}, **kw)
        ids = model.tokenizer(dp.PROMPTS[(prompt + i) % len(dp.PROMPTS)]).input_ids
        pending.append((i * arrive_every, ids, SamplingParams.from_flat(**flat), f"r{i}"))
    out, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, ids, params, rid = pending.pop(0)
            engine.add_request(ids, params, rid)
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend((r.position, r.token_id) for r in ev.revealed)
            if ev.finished:
                out[ev.request_id].append(ev.finish_reason)
        step += 1
    return out


def _assert_unchanged(seen):
    assert seen
    for obj, snap in seen.values():
        for now, then in zip([t for t in obj if isinstance(t, torch.Tensor)], snap):
            assert torch.equal(now, then), getattr(obj, "key", None)


@pytest.mark.parametrize("attention", ["prefix_causal", "bidirectional"])
def test_mixed_batch_leaves_shared_metadata_alone_and_equals_each_request_alone(shared_watch, attention):
    model = tiny.loaded(attention=attention, block_size=4, initializer_range=0.5,
                        **({} if attention == "prefix_causal" else dict(logit_shift=False)))
    reqs = MIXED if attention == "prefix_causal" else [
        dict(temperature=0, block_size=4, cache="dual"), dict(temperature=0, block_size=4, cache="prefix"),
        dict(temperature=0, block_size=4, cache="prefix", threshold=0.3), dict(temperature=0, block_size=4),
        dict(temperature=0, block_size=4, cache="dual", max_tokens=7)]
    batched = _run(model, reqs, prefix=attention == "prefix_causal")
    _assert_unchanged(shared_watch)
    for i, kw in enumerate(reqs):
        alone = _run(model, [kw], prefix=False, prompt=i)
        assert alone["r0"] == batched[f"r{i}"], kw
    _assert_unchanged(shared_watch)


def test_check_token_ids_edge_values():
    check_token_ids("x", [0, 9], 10)
    check_token_ids("x", [np.int64(3), np.int32(9)], 10)
    check_token_ids("x", [], 10)
    for bad in ([True], [0, False], [-1], [10], [np.int64(10)], [3.0], ["1"], [0] * 100_000 + [-5]):
        with pytest.raises(ParamError):
            check_token_ids("x", bad, 10)


def test_token_editing_alone_equals_in_a_batch_and_the_masked_memo_follows_the_edits(shared_watch):
    """LLaDA2's editing threshold rewrites revealed tokens (the window's bytes change without a reveal of a mask):
    each editing request alone = beside a plain and a refinement one; the window's masked positions after every
    step = a scan of the canvas."""
    from llada2_tiny import loaded_llada2

    model = loaded_llada2(seed=0)
    reqs = [dict(temperature=1.0, seed=7, threshold=0.6, editing_threshold=0.4, max_tokens=14),
            dict(temperature=0, threshold=0.6, max_tokens=9),
            dict(temperature=0, threshold=0.5, editing_threshold=0.3, max_tokens=12, stop=["e"])]
    batched = _run(model, reqs, prefix=False)
    _assert_unchanged(shared_watch)
    for i, kw in enumerate(reqs):
        assert _run(model, [kw], prefix=False, prompt=i)["r0"] == batched[f"r{i}"], kw
    llm = LLM(model, max_batch_size=4, enable_prefix_caching=False)
    engine = llm._engine(4)
    (req,) = engine.add_request(model.tokenizer(dp.PROMPTS[0]).input_ids, SamplingParams.from_flat(**reqs[0]), "e")
    while engine.has_unfinished():
        engine.step()
        if req.finished or req.win_idx >= len(req.windows):
            break
        _, s, e = req.windows[req.win_idx]
        want = np.flatnonzero(req.canvas[s:e].numpy() == model.dllm.mask_token_id) + s
        assert req._window_masked().tolist() == want.tolist()


def _stop_reference(model, ids, stop, min_tokens, eos_ids, max_tokens):
    """The stop rules over the whole unstopped output at once (no streaming, no skipped scans)."""
    from unmask.engine.stopping import StopChecker

    done = StopChecker(model.tokenizer, stop, min_tokens, eos_ids, max_tokens).update(list(ids), True)
    return (done[0], list(done[1]), done[2]) if done else None


@pytest.mark.parametrize("remasking", ["low_confidence", "left_to_right", "random"])
def test_stop_rules_across_blocks_equal_the_rules_over_the_whole_output(remasking):
    """Stop strings spanning a block boundary, under min_tokens, a stop id at a block's last position, max_tokens
    ending mid-block: the engine's finish (reason, ids, text) = the stop rules applied once to the output decoded
    without them (the stop-scan skip must never miss or delay a finish)."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    llm = LLM(model, max_batch_size=8, enable_prefix_caching=False)
    base = dict(temperature=0, block_size=4, speculative=False, remasking=remasking, seed=1, ignore_eos=True)
    full = llm.generate([dp.PROMPTS[0]], SamplingParams.from_flat(max_tokens=16, **base))[0].outputs[0].token_ids
    tok = model.tokenizer
    cases = []
    for b in (4, 8, 12):  # a stop string made of the text of the tokens on both sides of a block boundary
        text = tok.decode(full[b - 1:b + 1])
        if "\ufffd" not in text and text:
            cases.append(dict(stop=[text]))
            cases.append(dict(stop=[text], min_tokens=b + 1))
    cases += [dict(stop_token_ids=[full[3]]), dict(stop_token_ids=[full[7]]), dict(max_tokens=6),
              dict(max_tokens=9, stop=[tok.decode(full[7:9])] if "\ufffd" not in tok.decode(full[7:9]) else [])]
    assert len(cases) >= 5
    for case in cases:
        kw = dict(base, **dict(dict(max_tokens=16), **case))
        out = llm.generate([dp.PROMPTS[0]], SamplingParams.from_flat(**kw))[0].outputs[0]
        got = (out.finish_reason, list(out.token_ids), out.text)
        eos = set(case.get("stop_token_ids", []))
        want = _stop_reference(model, full[:kw["max_tokens"]], case.get("stop", []), case.get("min_tokens", 0), eos,
                               kw["max_tokens"])
        assert got == want, case


def test_filled_events_pickle_to_the_constructors_bytes():
    """``filled`` promises the object ``cls(**values)`` makes, pickled the same: its ``__dict__`` filled the
    defaults first, so a StepEvent pickled (Ray, multiprocessing) to other bytes, its fields in another order
    (``vars``/``__dict__`` iteration)."""
    import pickle

    from unmask.engine.outputs import CompletionOutput, Revealed, StepEvent, filled, revealed_token

    out = CompletionOutput(index=0, text="a", token_ids=[1], finish_reason="stop", logprobs=None, steps=2, nfe=2)
    for kw in (dict(request_id="r", block=0, step=1, nfe=1, revealed=[revealed_token(0, 5, 0.5, -0.7)],
                    canvas=[5, None], text="a"),
               dict(request_id="r", block=2, step=9, nfe=4, revealed=[], canvas=[1], text="a", finished=True,
                    finish_reason="stop", output=out, cached_tokens=3, index=1)):
        made, want = filled(StepEvent, **kw), StepEvent(**kw)
        assert made == want and repr(made) == repr(want)
        assert list(vars(made)) == list(vars(want))
        assert pickle.dumps(made) == pickle.dumps(want)
    assert pickle.dumps(revealed_token(1, 2, 0.5, -1.0, ((2, -1.0),))) == pickle.dumps(
        Revealed(1, 2, 0.5, -1.0, ((2, -1.0),)))


def _run_kw(model, reqs, prompts, arrive, **options) -> dict:
    """Tokens per request (position, id), request i arriving at step ``arrive[i]`` with ``prompts[i]``."""
    llm = LLM(model, max_batch_size=8, **options)
    engine = llm._engine(8)
    pending = sorted(((arrive[i], i) for i in range(len(reqs))))
    out, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            flat = dict({"speculative": False, "max_tokens": 10, "ignore_eos": True, "temperature": 0}, **reqs[i])
            engine.add_request(model.tokenizer(prompts[i]).input_ids, SamplingParams.from_flat(**flat), f"r{i}")
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend((r.position, r.token_id) for r in ev.revealed)
            out["cached"] = out.get("cached", 0) + ev.cached_tokens * ev.finished
        step += 1
    return out


@pytest.mark.parametrize("block_tokens", [3, 16])
def test_fragmented_pool_shared_prefix_blocks_and_chunked_prefill_equal_each_request_alone(monkeypatch,
                                                                                           block_tokens):
    """KV blocks of 3/5 tokens (no canvas a whole number of them), requests sharing prompt prefixes through the
    prefix cache (blocks shared, copied on write), chunked prefill, lanes of different lengths finishing at
    different steps (their blocks freed and taken again by later joiners): each request's tokens = alone without
    the prefix cache on the default pool."""
    from unmask.engine import kv_pool, prefix_cache

    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    base = "Hello world the quick brown fox jumps over the lazy dog " * 2
    prompts = [base, base + " again", base[:20], base + " again and again", base, base[:33]]
    reqs = [dict(max_tokens=3), dict(max_tokens=11, block_size=8, sub_block_size=4), dict(max_tokens=6),
            dict(max_tokens=9, speculative=True), dict(max_tokens=5, cfg_scale=0.5), dict(max_tokens=7,
                                                                                          threshold=0.3)]
    want = {f"r{i}": _run_kw(model, [kw], [prompts[i]], [0], enable_prefix_caching=False)["r0"]
            for i, kw in enumerate(reqs)}
    monkeypatch.setattr(kv_pool.KVPool.__init__, "__defaults__", (block_tokens, None))
    monkeypatch.setattr(prefix_cache, "BLOCK_TOKENS", block_tokens)  # the store's sharing unit follows the pool's
    got = _run_kw(model, reqs, prompts, [0, 0, 3, 5, 8, 10], enable_prefix_caching=True, prefill_chunk=7)
    assert got.pop("cached") > 0  # prompts read shared blocks
    assert got == want


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lowbit_weights_prompt_tiles_and_prefix_cache_equal_each_request_alone(shared_watch, fmt):
    """Under --weights int8/int4 (row-invariant forwards, prompt tiles): a mixed batch with the prefix cache and
    chunked prefill = each request alone without them, and the shared metadata untouched."""
    from unmask.engine import lowbit
    from unmask.engine.packed_weights import pack_model

    if lowbit.lowbit_unavailable(fmt, torch.device("cpu"), torch.float32) is not None:
        pytest.skip(f"no {fmt} CPU kernel in this torch/CPU")
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    pack_model(model, fmt)
    base = "Hello world the quick brown fox jumps over the lazy dog " * 2
    prompts = [base, base + " again", base[:30], base + "!"]
    reqs = [dict(max_tokens=4), dict(max_tokens=9, multi_block=0.5), dict(max_tokens=6, threshold=0.3),
            dict(max_tokens=7, speculative=True)]
    want = {f"r{i}": _run_kw(model, [kw], [prompts[i]], [0], enable_prefix_caching=False)["r0"]
            for i, kw in enumerate(reqs)}
    got = _run_kw(model, reqs, prompts, [0, 0, 4, 6], enable_prefix_caching=True, prefill_chunk=9)
    assert got.pop("cached") > 0
    assert got == want
    _assert_unchanged(shared_watch)


def test_infilling_alone_equals_in_a_batch(shared_watch):
    """A bidirectional canvas with a suffix (the window's masked positions stop before it) next to one without,
    under the prefix, dual and no cache: alone = batched."""
    model = tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4, initializer_range=0.5)
    reqs = [dict(suffix=" the end", max_tokens=7, cache="dual"), dict(max_tokens=7, cache="dual"),
            dict(suffix=" x y", max_tokens=9, cache="prefix", threshold=0.3), dict(suffix="!", max_tokens=5)]
    prompts = [dp.PROMPTS[i % 3] for i in range(len(reqs))]
    batched = _run_kw(model, reqs, prompts, [0, 0, 1, 2])
    for i, kw in enumerate(reqs):
        assert _run_kw(model, [kw], [prompts[i]], [0])["r0"] == batched[f"r{i}"], kw
    _assert_unchanged(shared_watch)


def test_a_memory_reading_answers_only_requests_needing_half_of_it_within_a_second(monkeypatch):
    """Memory dropping between two admissions: a reading under FREE_MEMORY_REUSE_S old answers a request needing at
    most half of it; a larger one, or any after the reading aged, reads again and is refused when it no longer
    fits."""
    import types

    import psutil

    from unmask.engine import scheduler as sched

    model = tiny.loaded(attention="prefix_causal", block_size=4)
    s = LLM(model, max_batch_size=2, enable_prefix_caching=False)._engine(2).scheduler
    avail, now, reads = [100 << 20], [1000.0], []
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reads.append(1) or types.SimpleNamespace(available=avail[0]))
    monkeypatch.setattr(sched.time, "monotonic", lambda: now[0])
    need = [0]
    monkeypatch.setattr(s, "estimate_bytes", lambda reqs: (need[0], 0))
    s.memory_reading.value = None
    need[0] = 40 << 20
    s.check_memory([])  # first reading: 100 MiB
    avail[0] = 45 << 20  # memory drops
    s.check_memory([])  # 40 <= 100 / 2, 0 s later: the reading answers
    assert len(reads) == 1
    need[0] = 51 << 20
    with pytest.raises(ParamError, match="max_tokens"):
        s.check_memory([])  # more than half: read again (45 MiB) and refused
    assert len(reads) == 2
    need[0] = 20 << 20
    now[0] += sched.FREE_MEMORY_REUSE_S
    avail[0] = 10 << 20
    with pytest.raises(ParamError, match="max_tokens"):
        s.check_memory([])  # the reading aged: read again
    assert len(reads) == 3


def test_speculative_branches_near_the_canvas_end_and_eos_alone_equal_batched():
    """Speculative drafts whose branches reach past the canvas (max_tokens 1..7 on 4-token blocks), with EOS on
    and off, beside plain requests ending mid-block: each alone = batched."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    reqs = [dict(speculative=True, max_tokens=m, ignore_eos=m % 2 == 0) for m in range(1, 8)]
    reqs += [dict(max_tokens=5, ignore_eos=False), dict(max_tokens=3, threshold=0.2)]
    prompts = [dp.PROMPTS[i % 3] for i in range(len(reqs))]
    batched = _run_kw(model, reqs, prompts, [i // 3 for i in range(len(reqs))])
    for i, kw in enumerate(reqs):
        assert _run_kw(model, [kw], [prompts[i]], [0])["r0"] == batched[f"r{i}"], kw


@pytest.mark.parametrize("cache", ["auto", "none"])
def test_block_causal_multi_block_and_cfg_alone_equal_batched(shared_watch, cache):
    """Multi-block (several active blocks: their own metadata, edited in place) beside CFG (an unconditional lane of
    the same canvas shape as its conditional one) and plain requests on a block-causal model with absolute blocks:
    alone = batched, and the shared metadata unchanged."""
    model = tiny.loaded(attention="block_causal", block_alignment="absolute", fixed_block_size=True, block_size=4,
                        initializer_range=0.5)
    reqs = [dict(multi_block=0.5, max_tokens=12, cache=cache), dict(cfg_scale=0.8, max_tokens=8, cache=cache),
            dict(max_tokens=8, cache=cache), dict(multi_block=0.25, threshold=0.3, max_tokens=11, cache=cache)]
    prompts = [dp.PROMPTS[0]] * 3 + [dp.PROMPTS[1]]
    batched = _run_kw(model, reqs, prompts, [0, 0, 1, 2])
    for i, kw in enumerate(reqs):
        assert _run_kw(model, [kw], [prompts[i]], [0])["r0"] == batched[f"r{i}"], kw
    _assert_unchanged(shared_watch)


def test_token_editing_with_the_prefix_cache_equals_alone_without_it():
    """LLaDA2 token editing (revealed tokens rewritten, the window's bytes changing without a mask revealed) on
    prompts sharing prefix-cache blocks: each request's tokens = alone without the prefix cache."""
    from llada2_tiny import loaded_llada2

    model = loaded_llada2(seed=0)
    base = "Hello world the quick brown fox jumps over the lazy dog " * 2
    prompts = [base, base + " again", base + "!"]
    reqs = [dict(threshold=0.6, editing_threshold=0.4, max_tokens=10), dict(threshold=0.6, max_tokens=9),
            dict(threshold=0.5, editing_threshold=0.3, max_tokens=12)]
    want = {f"r{i}": _run_kw(model, [kw], [prompts[i]], [0], enable_prefix_caching=False)["r0"]
            for i, kw in enumerate(reqs)}
    got = _run_kw(model, reqs, prompts, [0, 4, 6], enable_prefix_caching=True)
    assert got.pop("cached") > 0
    assert got == want
