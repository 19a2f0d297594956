"""The post-forward step over static shapes, and its CUDA graphs (docs/design.md#decoding, "Static shapes and CUDA
graphs"; ``--cuda-graphs``).

:func:`post_forward_step` is the batched reveal pass's device work (top-k/top-p, the draw, the scores, the reveal
rule: ``sampler.sample_groups`` after ``prepare_groups``, then ``reveal_rule.select_segments``) as one function of
tensors whose shapes come from :mod:`unmask.engine.buckets`' ladders: the rows' logits ``[R, V]`` and two parameter
tables, every per-row and per-segment value in them (temperatures, filters, counter-based keys, strategy codes,
segment rows, quotas, thresholds), and a few Python flags that pick which parts run. It reads no host value, so
``torch.compile(fullgraph=True)`` traces it whole and a CUDA graph can replay it. A padding row is a zero logit row
in no segment: every operation works row by row, so it changes no real row's result (tested, float32 and bf16).

:class:`StepGraphs` runs a step through it: the prepared logits (forbidden ids, ``min_tokens``, ``logit_bias`` and
penalties stay eager: their index lists change length every step) are copied into the bucket's static buffer, the
tables into theirs (two host-to-device copies), and the function is called, or, with ``capture``, its CUDA graph
for the bucket and flags is captured at first use (warm-up on a side stream, then ``torch.cuda.graph`` in one
memory pool shared by every graph) and replayed. Steps it cannot serve run the eager pass and are counted in
:attr:`StepGraphs.stats`: a request asking for ``top_logprobs`` (one ``topk`` per distinct k), sizes past a ladder's
top; the speculative, block-refinement and constrained sequences never reach it (their own passes, counted by the
denoiser). The canvas update stays on the host (``Sequence.reveal``), as it does without graphs.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from .buckets import ROW_BUCKETS, SEGMENT_BUCKETS, WIDTH_BUCKETS, bucket
from .noise import GUMBEL, REMASK
from .reveal_rule import choose_rows, segment_quota, select_segments
from .sampler import (Candidates, RowGroup, filter_rows, gumbel_argmax, log_normalizer, prepare_groups,
                      sample_groups, sampling_temperature, strategy_score)
from .transfer import copy_into

__all__ = ["STRATEGIES", "StepGraphs", "StepShape", "capture_step", "check_cuda_graphs", "post_forward_step",
           "step_tables"]

log = logging.getLogger("unmask.engine.step_graphs")

#: remasking strategies by code in the tables (0 = ``low_confidence``, the default)
STRATEGIES = ("low_confidence", "margin", "entropy", "random", "left_to_right")
#: int64 table: per row top_k, Gumbel key, remasking key, strategy code; then segment rows and quotas
INT_ROW_FIELDS = 4
#: float64 table: per row temperature, top_p, left-to-right order; then segment thresholds
FLOAT_ROW_FIELDS = 3
NO_THRESHOLD = 2.0  # above any probability


def check_cuda_graphs(enabled: bool, device: torch.device | str) -> None:
    """The ``cuda_graphs`` option against the model's ``device``.

    Raises:
        ValueError: ``cuda_graphs`` on a device that is not CUDA (names the option): there is nothing to capture,
            and the static step run uncaptured is slower than the eager pass (docs/results.md).
    """
    if enabled and torch.device(device).type != "cuda":
        raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, the model is on {device} "
                         "(docs/design.md#devices)")


@dataclass(frozen=True)
class StepShape:
    """A step's bucketed sizes and the parts it runs: what a CUDA graph is captured for.

    Attributes:
        rows, segments, width: the padded row count, segment count and segment width.
        vocab: V. sampled: some row draws (temperature > 0). top_k: the width of the one ``topk`` that finds
            every row's k-th value (the largest k asked, rounded up to a power of two, at most V; 0: no row has
            top-k). top_p: some row has a nucleus.
        strategies: the codes (:data:`STRATEGIES`) other than 0 some row uses. threshold: some segment has one.
    """

    rows: int
    segments: int
    width: int
    vocab: int
    sampled: bool
    top_k: int
    top_p: bool
    strategies: tuple[int, ...]
    threshold: bool

    def flags(self) -> dict:
        """The keywords of :func:`post_forward_step` besides the tensors."""
        return dict(segments=self.segments, width=self.width, sampled=self.sampled, top_k=self.top_k,
                    top_p=self.top_p, strategies=self.strategies, threshold=self.threshold)


def post_forward_step(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, *, segments: int, width: int,
                      sampled: bool, top_k: int, top_p: bool, strategies: tuple[int, ...], threshold: bool
                      ) -> tuple[torch.Tensor, ...]:
    """Steps 4-7 of docs/design.md#decoding for ``R`` prepared rows over static shapes, no host read.

    Args:
        logits: ``[R, V]`` float32, prepared (``sampler.prepare_groups``); a padding row is any finite row.
        ints: ``[4R + S*W + S]`` int64: per row top_k (0: none), Gumbel key, remasking key, strategy code; each
            segment's rows ``[S, W]`` (padded with R); each segment's quota (0 for a padding segment).
        floats: ``[3R + S]`` float64: per row temperature (0: argmax), top_p (1: none; compared in float32 as the
            eager filter does), left-to-right order; each segment's threshold (2.0: none).
        segments, width: S and W. sampled, top_p, threshold: whether any row or segment needs that part; top_k:
        0, or the width of the k-th-value ``topk`` (>= every row's k); strategies: the non-default codes present.

    Returns:
        ``[R]`` tokens (int64), probability (float64), log-probability (float32), score (float64), chosen (bool):
        what ``sample_groups`` + ``select_segments`` give for the real rows, bit for bit (tested).
    """
    R = logits.shape[0]
    S, W = segments, width
    k_rows, g_keys, r_keys, codes = ints[:R], ints[R:2 * R], ints[2 * R:3 * R], ints[3 * R:4 * R]
    idx = ints[4 * R:4 * R + S * W].view(S, W)
    quota = ints[4 * R + S * W:4 * R + S * W + S].view(S, 1)
    temps, p_rows, order = floats[:R], floats[R:2 * R], floats[2 * R:3 * R]
    tau = floats[3 * R:3 * R + S].view(S, 1)
    if top_k or top_p:
        logits = filter_rows(logits, k_rows if top_k else None, p_rows.float() if top_p else None, top_k or None)
    tokens = torch.argmax(logits, dim=-1)
    if sampled:
        hot = temps > 0
        drawn = gumbel_argmax(logits.to(torch.float64) / torch.where(hot, temps, 1.0)[:, None], g_keys)
        tokens = torch.where(hot, drawn, tokens)
    lse = log_normalizer(logits)
    logprob = logits.gather(-1, tokens[:, None])[:, 0].to(torch.float64) - lse
    probability = logprob.exp()
    score = probability
    for code in strategies:
        own = strategy_score(STRATEGIES[code], logits, lse, probability, r_keys, order)
        score = torch.where(codes == code, own, score)
    chosen = choose_rows(score, probability, idx, quota, tau if threshold else None)
    return tokens, probability, logprob.float(), score, chosen


def step_tables(groups: list[RowGroup], segments: list[tuple[int, int, int | None, float | None]], rows: int,
                vocab: int) -> tuple[StepShape, torch.Tensor, torch.Tensor] | str:
    """The host tables of :func:`post_forward_step` for ``rows`` rows of ``groups`` and ``segments`` (as
    ``select_segments`` takes them), bucketed; or why the step cannot be served (a string naming it).

    Returns:
        ``(shape, ints, floats)``: the :class:`StepShape` and the CPU int64 / float64 tables.
    """
    if any(g.params.top_logprobs for g in groups if g.n):
        return "top_logprobs"
    width = max([hi - lo for lo, hi, _, _ in segments] + [1])
    R, S, W = bucket(rows, ROW_BUCKETS), bucket(len(segments), SEGMENT_BUCKETS), bucket(width, WIDTH_BUCKETS)
    for name, size in (("rows", R), ("segments", S), ("width", W)):
        if size is None:
            return name
    ints = torch.zeros(INT_ROW_FIELDS * R + S * W + S, dtype=torch.long)
    floats = torch.zeros(FLOAT_ROW_FIELDS * R + S, dtype=torch.float64)
    k_rows, g_keys, r_keys, codes = ints[:R], ints[R:2 * R], ints[2 * R:3 * R], ints[3 * R:4 * R]
    temps, p_rows, order = floats[:R], floats[R:2 * R], floats[2 * R:3 * R]
    p_rows.fill_(1.0)
    used = set()
    for g in groups:
        if not g.n:
            continue
        p, at = g.params, slice(g.lo, g.hi)
        temp = sampling_temperature(p)
        k_rows[at], temps[at], p_rows[at] = int(p.top_k or 0), temp, float(p.top_p)
        code = STRATEGIES.index(p.remasking or "low_confidence")
        codes[at] = code
        used.add(code)
        if temp:
            g_keys[at] = g.draws.keys(GUMBEL, g.n)
        if STRATEGIES[code] == "random":
            r_keys[at] = g.draws.keys(REMASK, g.n)
        if STRATEGIES[code] == "left_to_right":
            order[at] = torch.arange(g.left_to_right_base, g.left_to_right_base + g.n, dtype=torch.float64)
    idx = ints[INT_ROW_FIELDS * R:INT_ROW_FIELDS * R + S * W].view(S, W)
    idx.fill_(R)
    quota, tau = ints[INT_ROW_FIELDS * R + S * W:], floats[FLOAT_ROW_FIELDS * R:]
    tau.fill_(NO_THRESHOLD)
    for s, (lo, hi, q, t) in enumerate(segments):
        idx[s, :hi - lo] = torch.arange(lo, hi)
        quota[s] = segment_quota(lo, hi, q, t)
        if t is not None:
            tau[s] = float(t)
    live = [g for g in groups if g.n]
    k_max = max([int(g.params.top_k or 0) for g in live if 0 < int(g.params.top_k or 0) < vocab] + [0])
    shape = StepShape(R, S, W, vocab, sampled=any(sampling_temperature(g.params) for g in live),
                      top_k=min(1 << (k_max - 1).bit_length(), vocab) if k_max else 0,
                      top_p=any(g.params.top_p < 1.0 for g in live), strategies=tuple(sorted(used - {0})),
                      threshold=any(t is not None for *_, t in segments))
    return shape, ints, floats


@dataclass
class CapturedStep:
    """A captured CUDA graph and the outputs its replays write (static tensors)."""

    graph: object
    outputs: tuple[torch.Tensor, ...]

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


def capture_step(fn: Callable[..., tuple], args: tuple, pool=None, warmup: int = 2) -> CapturedStep:
    """Capture ``fn(*args)`` (static input tensors) as a CUDA graph: ``warmup`` calls on a side stream first (lazy
    library initialisation and the allocator's first blocks stay out of the graph, as torch's docs prescribe),
    then one call under ``torch.cuda.graph`` in ``pool`` (``torch.cuda.graph_pool_handle()``: graphs captured one
    after another share it, safe because a step's outputs are read before the next replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's other threads (HTTP, metrics) may touch CUDA while the engine thread captures
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = fn(*args)
    return CapturedStep(graph, outputs)


@dataclass
class StaticInputs:
    """One bucket's input buffers on the device (every graph of the bucket reads them)."""

    logits: torch.Tensor
    ints: torch.Tensor
    floats: torch.Tensor


#: default cap on captured graphs (buckets x parts seen); beyond it a new shape runs uncaptured
MAX_GRAPHS = 64


class StepGraphs:
    """The batched reveal pass through :func:`post_forward_step` (bucketed), with CUDA graphs under ``capture``.

    Args:
        device: the model's device. capture: capture and replay CUDA graphs (a CUDA device; the engine refuses
            ``cuda_graphs`` elsewhere, ``unmask.engine.denoiser``); without it the function runs eagerly over the
            same static buffers. warmup: calls before a capture. max_graphs: the most graphs captured (each
            holds memory of the shared pool, outside the KV budget, and its capture synchronizes the device; vLLM
            captures a few dozen sizes); later new shapes run uncaptured.

    Attributes:
        stats: counts: ``graph_steps`` (replays), ``static_steps`` (uncaptured calls), ``captures``, ``eager_steps``
            and ``eager:<reason>`` (a step or sequence served by the eager passes, by reason; ``eager:capture
            failed``: a step of a shape whose capture raised, run through the static step uncaptured, logged;
            ``eager:graph cap``: a new shape once ``max_graphs`` are captured, run uncaptured).
        graphs: the captured graphs by :class:`StepShape`.
    """

    def __init__(self, device: torch.device | str, capture: bool = False, warmup: int = 2,
                 max_graphs: int = MAX_GRAPHS):
        self.device = torch.device(device)
        self.capture = capture
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.stats: Counter = Counter()
        self.graphs: dict[StepShape, CapturedStep] = {}
        self._inputs: dict[tuple[int, ...], StaticInputs] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}  # one [R, V] buffer per row bucket
        self._uncapturable: set[StepShape] = set()  # shapes whose capture failed: run uncaptured
        self._pool = None

    def note_eager(self, reason: str, count: int = 1) -> None:
        """Count ``count`` sequences or steps served by an eager pass for ``reason`` (logged the first time)."""
        if not self.stats[f"eager:{reason}"]:
            log.info("cuda graphs: %s runs eagerly (counted in StepGraphs.stats)", reason)
        self.stats[f"eager:{reason}"] += count

    def sample_and_select(self, logits: torch.Tensor, groups: list[RowGroup],
                          segments: list[tuple[int, int, int | None, float | None]],
                          forbidden_ids: torch.Tensor | None = None) -> tuple[Candidates, torch.Tensor]:
        """``sample_groups(logits, groups, forbidden_ids)`` and ``select_segments`` of it over ``segments``: the
        same candidates (without ``top_*``) and ``[N]`` chosen rows, through the static step where it can serve
        them (the step's outputs are the graph's: read them before the next call)."""
        n = int(logits.shape[0])
        planned = step_tables(groups, segments, n, int(logits.shape[-1])) if n else "no rows"
        if isinstance(planned, str):
            self.note_eager(planned)
            self.stats["eager_steps"] += 1
            cands = sample_groups(logits, groups, forbidden_ids)
            return cands, select_segments(cands, segments)
        shape, ints, floats = planned
        static = self._static(shape)
        prepared = prepare_groups(logits, groups, forbidden_ids)
        static.logits[:n].copy_(prepared)
        static.logits[n:].zero_()
        copy_into(static.ints, ints)
        copy_into(static.floats, floats)
        tokens, probability, logprob, score, chosen = self._run(shape, static)
        return Candidates(tokens[:n], probability[:n], score[:n], logprob[:n]), chosen[:n]

    def _static(self, shape: StepShape) -> StaticInputs:
        """The bucket's input buffers: tables per (rows, segments, width), the ``[R, V]`` logits buffer shared by
        every shape of its row bucket (the largest buffer by far: 8192 x V float32 is 4.1 GB at LLaDA-8B's vocabulary;
        each step fills it before its replay)."""
        key = (shape.rows, shape.segments, shape.width, shape.vocab)
        if key not in self._inputs:
            R, S, W, V = key
            if (R, V) not in self._logits:
                self._logits[R, V] = torch.zeros(R, V, dtype=torch.float32, device=self.device)
            self._inputs[key] = StaticInputs(
                self._logits[R, V],
                torch.zeros(INT_ROW_FIELDS * R + S * W + S, dtype=torch.long, device=self.device),
                torch.zeros(FLOAT_ROW_FIELDS * R + S, dtype=torch.float64, device=self.device))
        return self._inputs[key]

    def _run(self, shape: StepShape, static: StaticInputs) -> tuple[torch.Tensor, ...]:
        args = (static.logits, static.ints, static.floats)
        if not self.capture:
            self.stats["static_steps"] += 1
            return post_forward_step(*args, **shape.flags())
        captured = self.graphs.get(shape)
        if captured is None and shape in self._uncapturable:
            self.note_eager("capture failed")
            return post_forward_step(*args, **shape.flags())
        if captured is None and len(self.graphs) >= self.max_graphs:
            self.note_eager("graph cap")  # each capture holds pool memory and synchronizes the device
            return post_forward_step(*args, **shape.flags())
        if captured is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            flags = shape.flags()
            try:
                captured = capture_step(lambda *a: post_forward_step(*a, **flags), args, self._pool, self.warmup)
            except RuntimeError as exc:  # not every request of this shape, every step, failing on it
                log.warning("cuda graphs: capturing %s failed, its steps run uncaptured: %s", shape, exc)
                self._uncapturable.add(shape)
                return self._run(shape, static)
            self.graphs[shape] = captured
            self.stats["captures"] += 1
            log.info("cuda graphs: captured the post-forward step for %s (%d graphs)", shape, len(self.graphs))
        self.stats["graph_steps"] += 1
        return captured.replay()
