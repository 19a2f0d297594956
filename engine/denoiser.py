"""One batched denoising step over many sequences (DESIGN.md section 4, steps 1-8).

Each sequence contributes one row per lane (two under CFG). Rows are right-padded to the longest chunk; the keys
of a row are its lane's cached KV (padded to the longest cache) followed by its chunk. The boolean mask comes from
the shared builder (``unmask.engine.attention``), so padding never changes a row's result: a row decodes the same
tokens alone or in any batch (batch invariance, DESIGN.md section 10).
"""
from __future__ import annotations

import torch

from .attention import build_attention_mask
from .kv_cache import BatchKV
from .model import LoadedModel
from .sampler import classifier_free_guidance, sample_candidates
from .sequence import LaneInput, Sequence, StepEvent
from .speculative import SpeculativeSequence


class Denoiser:
    """Runs steps for a list of sequences on one model.

    Args:
        model: the loaded model.
        compile: run the decoder forward through ``torch.compile(dynamic=True)`` (same results; the first steps
            of each new shape pay the compilation). Measured in ``benchmarks/bench_overhead.py --compile``; off by
            default because it did not pay on the CPU measured (see the README "Performance" section). Needs
            ``native`` weights.

    Raises:
        ValueError: ``compile`` on a model with packed weights (names ``compile``).
    """

    def __init__(self, model: LoadedModel, compile: bool = False):
        self.model = model
        self.device = model.device
        self.forbidden = torch.tensor(model.dllm.never_generate_ids, dtype=torch.long, device=self.device)
        self.forwards = 0  # batched forward passes run by this denoiser (engine-level NFE)
        self.compiled = bool(compile)
        if compile:
            model.enable_compile()

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[StepEvent]:
        """Run one denoising step for every sequence in ``seqs`` (none may be finished).

        The sequences' rows go through one forward, or a few when their chunks differ so much in length that
        padding them into one ``[B, Q]`` batch would waste most of its rows (a joining sequence's prompt prefill
        next to one-row decoding steps): see :func:`plan_forwards`. Results do not depend on the grouping
        (batch invariance).

        Returns:
            one :class:`StepEvent` per sequence, in order.
        """
        if not seqs:
            return []
        inputs = [seq.lane_inputs() for seq in seqs]
        events: list[StepEvent | None] = [None] * len(seqs)
        widths = [max(int(inp.chunk.numel()) for inp in lane_ins) for lane_ins in inputs]
        for group in plan_forwards(widths, [len(lane_ins) for lane_ins in inputs], self.forward_overhead_rows):
            for i, event in zip(group, self._step_group([seqs[i] for i in group], [inputs[i] for i in group])):
                events[i] = event
        return events

    #: fixed cost of one batched forward, in padded rows (weight streaming, per-layer launches): the
    #: :func:`plan_forwards` cost model. On the 2-core CPU measured, a 1-row pass of the 30 layers' linears takes
    #: ~30 ms and each further row ~4 ms (``benchmarks/bench_gemm_rows.py``): ~8 rows; GPUs are higher.
    forward_overhead_rows = 16

    def _step_group(self, seqs: list[Sequence], inputs: list[list[LaneInput]]) -> list[StepEvent]:
        """One forward for ``seqs`` whose lane inputs (``inputs[i]`` for ``seqs[i]``) were already taken."""
        rows: list[tuple[Sequence, int, LaneInput]] = []
        for seq, lane_ins in zip(seqs, inputs):
            for li, lane_in in enumerate(lane_ins):
                rows.append((seq, li, lane_in))
        logits_by_row, kv, hidden = self._forward(rows)
        events = []
        r = 0
        for seq in seqs:
            n_lanes = len(seq.lanes)
            seq.nfe += n_lanes
            if isinstance(seq, SpeculativeSequence):  # one lane; its commit is decided by the verification
                _, _, inp = rows[r]
                features = hidden[r, inp.feature_rows] if inp.feature_rows is not None else None
                event, commit = seq.verify(logits_by_row[r], self.forbidden, features=features)
                if commit.numel():
                    kv.commit(r, commit.to(self.device), seq.lanes[0].cache, inp.chunk[commit], inp.grp[commit])
                events.append(event)
                r += 1
                continue
            cond = logits_by_row[r]
            if n_lanes == 2:
                cond = classifier_free_guidance(cond, logits_by_row[r + 1], seq.params.cfg_scale)
            r += n_lanes
            masked = seq.masked_positions()
            cands = sample_candidates(
                cond, seq.params, seq.generator, forbidden_ids=self.forbidden,
                forbidden_rows=seq.min_tokens_rows(masked), row_forbidden_ids=seq.min_tokens_ids.to(self.device),
                context_ids=seq.context_ids() if _has_penalty(seq) else None,
            )
            events.append(seq.apply(cands, masked))
        return events

    def _forward(self, rows: list[tuple[Sequence, int, LaneInput]]
                 ) -> tuple[list[torch.Tensor], BatchKV, torch.Tensor]:
        """Batched forward; commits KV into lane caches (rows whose ``commit`` is not ``None``); returns the
        ``[N_r, V]`` logits per row (needed outputs), the forward's :class:`BatchKV` (for later commits) and the
        ``[B, Q, H]`` last hidden states (for draft heads)."""
        dev = self.device
        B = len(rows)
        Q = max(int(inp.chunk.numel()) for _, _, inp in rows)
        input_ids = torch.zeros(B, Q, dtype=torch.long, device=dev)
        pos = torch.zeros(B, Q, dtype=torch.long, device=dev)
        grp = torch.full((B, Q), -2, dtype=torch.long, device=dev)
        start = torch.zeros(B, Q, dtype=torch.long, device=dev)
        committed = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        valid = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        # with a row variant (a verifier, unmask.engine.routed): the causal rows of speculative requests run it
        routed = self.model.has_row_variant
        variant_rows = torch.zeros(B, Q, dtype=torch.bool, device=dev) if routed else None
        lanes = []
        for b, (seq, li, inp) in enumerate(rows):
            n = int(inp.chunk.numel())
            input_ids[b, :n] = inp.tokens
            pos[b, :n] = inp.chunk
            grp[b, :n] = inp.grp
            start[b, :n] = inp.start
            committed[b, :n] = inp.committed
            valid[b, :n] = True
            if routed and isinstance(seq, SpeculativeSequence):
                variant_rows[b, :n] = inp.committed
            lane_cache = seq.lanes[li].cache
            if inp.replace_cache:
                lane_cache.reset()  # refilled by this forward: keep the buffers
            lanes.append(lane_cache)
        kv = BatchKV(lanes, dev)
        c_pos, c_grp, c_valid = kv.key_meta()
        mask = build_attention_mask(
            q_pos=pos, q_grp=grp, q_start=start, q_valid=valid,
            k_pos=torch.cat([c_pos, pos], 1), k_grp=torch.cat([c_grp, grp], 1),
            k_committed=torch.cat([c_valid, committed], 1), k_valid=torch.cat([c_valid, valid], 1),
        )
        hidden = self.model.hidden_states(input_ids, pos, mask, cache=kv, variant_rows=variant_rows)
        self.forwards += 1

        # gather the needed outputs (and carries) in one LM-head call
        # (the carry - the last committed token's output - is often also a needed row: at block 1 it is the only
        # one; it is then read from that row instead of going through the LM head twice)
        gather_rows, gather_cols, spans = [], [], []
        for b, (seq, li, inp) in enumerate(rows):
            idx = inp.needed[inp.needed >= 0].tolist()
            carry_at, extra = -1, []
            if inp.carry_index >= 0:
                if inp.carry_index in idx:
                    carry_at = idx.index(inp.carry_index)
                else:
                    extra = [inp.carry_index]
            spans.append((len(gather_cols), len(idx), len(extra), carry_at))
            gather_cols.extend(idx + extra)
            gather_rows.extend([b] * (len(idx) + len(extra)))
        g_rows = torch.tensor(gather_rows, dtype=torch.long, device=dev)
        g_cols = torch.tensor(gather_cols, dtype=torch.long, device=dev)
        logits = self.model.logits(hidden[g_rows, g_cols],
                                   variant_rows=variant_rows[g_rows, g_cols] if routed else None)

        out = []
        for b, (seq, li, inp) in enumerate(rows):
            off, n_needed, n_extra, carry_at = spans[b]
            lane_cache = seq.lanes[li].cache
            got = logits[off: off + n_needed]
            if bool((inp.needed < 0).any()):
                row_logits = torch.empty(inp.needed.numel(), got.shape[-1], dtype=got.dtype, device=dev)
                row_logits[inp.needed >= 0] = got
                row_logits[inp.needed < 0] = lane_cache.carry_logits
            else:
                row_logits = got
            out.append(row_logits)
            if inp.commit is not None and inp.commit.numel():
                kv.commit(b, inp.commit, lane_cache, inp.chunk[inp.commit], inp.grp[inp.commit])
            if n_extra or carry_at >= 0:
                lane_cache.carry_logits = logits[off + (n_needed if n_extra else carry_at)]
                lane_cache.carry_position = int(inp.chunk[inp.carry_index])
        return out, kv, hidden


def plan_forwards(widths: list[int], lanes: list[int], overhead_rows: int) -> list[list[int]]:
    """Split one step's sequences into forwards that minimise padded work.

    A forward over sequences ``g`` pads every row to the longest chunk, so it costs about
    ``overhead_rows + sum(lanes[i] for i in g) * max(widths[i] for i in g)`` row-computations. Sorted by width,
    the best split into contiguous runs is found by dynamic programming (O(n^2), n <= the batch size). One joining
    sequence's 40-token prompt next to 31 one-row decoding steps: 1 padded forward = 16 + 32 x 40 = 1,296 rows; the
    plan's two forwards = 16 + 31 + 16 + 40 = 103.

    Args:
        widths: ``[n]`` chunk length (tokens forwarded) of each sequence's widest lane, >= 1.
        lanes: ``[n]`` rows each sequence contributes (2 under CFG).
        overhead_rows: the fixed cost of a forward, in rows (>= 0; 0 never pads, large never splits).

    Returns:
        groups of indices into ``widths``, each sorted ascending, covering every index once.
    """
    n = len(widths)
    if n <= 1:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: widths[i])
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sequences of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        rows = 0
        for i in range(j, 0, -1):  # last group = order[i-1 : j], padded to widths[order[j-1]]
            rows += lanes[order[i - 1]]
            cost = best[i - 1] + overhead_rows + rows * widths[order[j - 1]]
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0
