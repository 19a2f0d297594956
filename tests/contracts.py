"""The checks of docs/design.md#exactness-contracts-by-device-and-dtype, as functions of a loaded model, so that
the CPU cells (``tests/engine/test_contracts.py``) and a GPU lane run the same checks.

Each check decodes the same requests two ways (alone / in a batch, speculative / block 1, reusing a prefix / fresh,
exact cache / none, chunked / whole prefill) with one :class:`~unmask.engine.engine.Engine` over one model and
compares them with :func:`assert_same_decoding`: ``tol=None`` = exact (tokens equal, every step's logits bit for
bit); ``tol=x`` = while both decoded the same canvas, every step's logits within ``x`` times the step's largest
``|logit|``, and the tokens equal unless they part right after a near-tie (a step whose top-2 logits of a row, or
whose candidates' confidences across rows, are within ``2 x`` of each other).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from unmask.engine import SamplingParams
from unmask.engine import denoiser
from unmask.engine.engine import Engine
from unmask.engine.sequence import Sequence
from unmask.engine.speculative import SpeculativeSequence

PROMPTS = ("Hello world the quick brown", "the quick brown fox jumps", "Hello world")
#: a prompt of more than two prefix-cache chunks (16 tokens each) for the reuse check
LONG = "The quick brown fox jumps over the lazy dog. One two three four five six seven eight nine ten."
GREEDY = dict(temperature=0, speculative=False, ignore_eos=True)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Inside: every request keeps ``steps`` = ``[(canvas before the step [L] int64, [lane logits [N, V]
    float32])]``, one entry per denoising step (prompt chunks have none)."""
    saved = {cls: cls.__dict__["consume"] for cls in (Sequence, SpeculativeSequence)}
    batched = denoiser.consume_batch

    def record(seq, logits):
        seq.__dict__.setdefault("steps", []).append(
            (seq.canvas.detach().cpu().clone(), [t.detach().float().cpu().clone() for t in logits]))

    def wrap(consume):
        def recorded(self, logits, forbidden_ids):
            record(self, logits)
            return consume(self, logits, forbidden_ids)

        return recorded

    def recorded_batch(seqs, spans, logits, forbidden_ids):  # the batched pass (engine/batch_step.py)
        for seq, lane_spans in zip(seqs, spans):
            record(seq, [logits[a:b] for a, b in lane_spans])
        return batched(seqs, spans, logits, forbidden_ids)

    for cls, consume in saved.items():
        cls.consume = wrap(consume)
    denoiser.consume_batch = recorded_batch
    table_steps = denoiser.Denoiser.table_steps
    denoiser.Denoiser.table_steps = False  # the table step (engine/plain_batch.py) = this path: tests/engine/test_plain_table.py
    try:
        yield
    finally:
        for cls, consume in saved.items():
            cls.consume = consume
        denoiser.consume_batch = batched
        denoiser.Denoiser.table_steps = table_steps


def _block(model, size: int) -> int | None:
    """``size``, or ``None`` (the trained block) on a model that decodes with its own block size only."""
    return None if model.dllm.fixed_block_size else size


def decode(engine: Engine, requests: list[tuple[str | list[int], SamplingParams]]) -> list:
    """Decode ``requests`` (prompt text or ids, params) together in ``engine``; returns their finished requests."""
    tok = engine.model.tokenizer
    reqs = []
    for i, (prompt, params) in enumerate(requests):
        ids = prompt if isinstance(prompt, list) else tok(prompt).input_ids
        reqs += engine.add_request(ids, params, f"c{i}-{id(params)}")
    with recording():
        while engine.has_unfinished():
            engine.step()
    return reqs


def near_tie(logits: list[torch.Tensor], delta: float) -> bool:
    """Whether a step's decision could flip under a logit change of ``delta``: a row's top-2 logits within
    ``delta``, or two rows' candidate probabilities within ``delta`` (the reveal order)."""
    rows = logits[0]
    top2 = rows.topk(2, dim=-1).values
    if bool(((top2[:, 0] - top2[:, 1]) <= delta).any()):
        return True
    conf = torch.softmax(rows, dim=-1).amax(dim=-1).sort().values
    return conf.numel() > 1 and bool((conf[1:] - conf[:-1] <= delta).any())


def _difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(largest |a - b|, largest finite |a|)``; equal entries (-inf included) differ by 0, an inf against a
    finite value by inf."""
    d = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    finite = a[torch.isfinite(a)]
    return float(d.max()), float(finite.abs().max()) if finite.numel() else 0.0


def assert_same_decoding(ref, got, tol: float | None, what: str) -> None:
    """``got`` decoded as ``ref`` did: exactly (``tol=None``) or within ``tol`` (module docstring).

    Raises:
        AssertionError: naming ``what``, the step and the difference.
    """
    same_canvas = 0
    for i, ((canvas_a, la), (canvas_b, lb)) in enumerate(zip(ref.steps, got.steps)):
        if not torch.equal(canvas_a, canvas_b):
            break
        same_canvas = i + 1
        for a, b in zip(la, lb):
            assert a.shape == b.shape, f"{what}: step {i} read other rows {tuple(a.shape)} vs {tuple(b.shape)}"
            diff, scale = _difference(a, b)
            if tol is None:
                assert torch.equal(a, b), f"{what}: step {i} logits differ by {diff:.3g}"
            else:
                assert diff <= tol * scale, f"{what}: step {i} logits differ by {diff / scale:.3g} > {tol} (relative)"
    if ref.output_ids == got.output_ids:
        return
    assert tol is not None, f"{what}: tokens differ: {ref.output_ids} vs {got.output_ids}"
    d = same_canvas - 1  # the last step both took from the same canvas: its decisions parted them
    assert d >= 0, f"{what}: the first step already started from different canvases"
    scale = _difference(ref.steps[d][1][0], ref.steps[d][1][0])[1]
    assert near_tie(ref.steps[d][1], 2 * tol * scale), (
        f"{what}: tokens part after step {d} without a near-tie: {ref.output_ids} vs {got.output_ids}")


def check_batch_invariance(model, tol: float | None, sampled: bool = True) -> None:
    """Each request decoded in one batch (different prompt lengths, blocks and parameters) = decoded alone."""
    third = dict(temperature=1.0, seed=3, speculative=False, ignore_eos=True) if sampled else GREEDY
    params = [SamplingParams(max_tokens=10, block_size=_block(model, 4), **GREEDY),
              SamplingParams(max_tokens=8, block_size=_block(model, 1), **GREEDY),
              SamplingParams(max_tokens=9, block_size=_block(model, 2), **third)]
    engine = Engine(model, enable_prefix_caching=False)
    requests = list(zip(PROMPTS, params))
    together = decode(engine, requests)
    for r, request in zip(together, requests):
        assert_same_decoding(decode(engine, [request])[0], r, tol, f"batched {request[1].block_size=}")


def check_speculative_is_block_1(model, tol: float | None) -> None:
    """Greedy self-speculative decoding (drafts of 4, alone and batched) = block 1, token for token; under ``tol``
    a difference only right after a near-tie of block 1's own logits."""
    engine = Engine(model, enable_prefix_caching=False, default_drafts="on")
    spec = SamplingParams(max_tokens=12, temperature=0, block_size=4, speculative=True, ignore_eos=True)
    b1 = SamplingParams(max_tokens=12, block_size=1, **GREEDY)
    together = decode(engine, [(p, spec) for p in PROMPTS])
    for prompt, batched in zip(PROMPTS, together):
        ref = decode(engine, [(prompt, b1)])[0]
        for got, how in ((decode(engine, [(prompt, spec)])[0], "alone"), (batched, "batched")):
            if got.output_ids == ref.output_ids:
                continue
            assert tol is not None, f"speculative ({how}) {got.output_ids} != block 1 {ref.output_ids}"
            j = next(i for i, (a, b) in enumerate(zip(ref.output_ids, got.output_ids)) if a != b)
            logits = ref.steps[j][1]
            assert near_tie(logits, 2 * tol * _difference(logits[0], logits[0])[1]), (
                f"speculative ({how}) parts from block 1 at token {j} without a near-tie")


def check_prefix_reuse(model, tol: float | None) -> None:
    """A second turn that starts with the first turn's prompt and answer, its prefix loaded from the prefix cache,
    = the same request prefilled fresh (plain diffusion block 4 and block 1)."""
    tok = model.tokenizer
    for params in (SamplingParams(max_tokens=8, block_size=_block(model, 4), **GREEDY),
                   SamplingParams(max_tokens=8, block_size=_block(model, 1), **GREEDY)):
        reuse = Engine(model, enable_prefix_caching=True)
        first = decode(reuse, [(LONG, params)])[0]
        turn = tok(LONG).input_ids + first.output_ids + tok(" and then").input_ids
        hits = reuse.prefix_cache_stats()["hits"]
        reused = decode(reuse, [(turn, params)])[0]
        assert reuse.prefix_cache_stats()["hits"] > hits, "the second turn did not reuse the prefix"
        fresh = decode(Engine(model, enable_prefix_caching=False), [(turn, params)])[0]
        assert_same_decoding(fresh, reused, tol, f"prefix reuse {params.block_size=}")


def check_cache_is_no_cache(model, tol: float | None) -> None:
    """The exact KV cache (prefix- or block-causal model) = no cache, blocks 1, 3 and 4."""
    engine = Engine(model, enable_prefix_caching=False)
    for block in (1, 3, 4):
        for prompt in PROMPTS[:2]:
            kw = dict(max_tokens=9, block_size=_block(model, block), **GREEDY)
            none = decode(engine, [(prompt, SamplingParams(cache="none", **kw))])[0]
            cached = decode(engine, [(prompt, SamplingParams(cache="auto", **kw))])[0]
            assert_same_decoding(none, cached, tol, f"cache vs none, block {block}")
        if model.dllm.fixed_block_size:
            break


def check_chunked_prefill(model, tol: float | None) -> None:
    """A prompt prefilled in chunks of 8 row-equivalents = prefilled whole."""
    params = SamplingParams(max_tokens=8, block_size=_block(model, 4), **GREEDY)
    whole = decode(Engine(model, enable_prefix_caching=False, prefill_chunk=0), [(LONG, params)])[0]
    chunked = decode(Engine(model, enable_prefix_caching=False, prefill_chunk=8), [(LONG, params)])[0]
    assert_same_decoding(whole, chunked, tol, "chunked prefill")
