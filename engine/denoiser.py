"""One batched denoising step over many requests (docs/design.md#decoding, steps 1-8).

Each request contributes one row per lane (two under CFG). Rows are right-padded to the longest chunk; the keys
of a row are its lane's cached KV (padded to the longest cache) followed by its chunk. The boolean mask comes from
the shared builder (``unmask.engine.attention``), so padding never changes a row's result: a row decodes the same
tokens alone or in any batch (batch invariance, docs/design.md#decisions).

The denoiser knows requests only through the strategy protocol (``unmask.engine.request.DecodingStrategy``:
``lane_inputs``, ``variant_rows``, ``consume``) and the model only through its seam (``hidden_states`` and
``logits`` with ``variant_rows``): one forward path, whatever the strategy.
"""
from __future__ import annotations

import torch

from .attention import build_attention_mask
from .kv_cache import BatchKV
from .limits import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from .model import LoadedModel
from .outputs import StepEvent
from .prefill_cost import PrefillBudget, attention_crossover_keys
from .request import DecodingStrategy, LaneInput
from .row_attention import PROMPT_TILE


class Denoiser:
    """Runs steps for a list of requests on one model.

    Args:
        model: the loaded model (``model.enable_compile()`` compiles its decoder forward).
        compile: call ``model.enable_compile()`` first (kept for old callers).
        prefill_chunk: what a sequence's prompt chunk before its first denoising step, and a step's prompt rows in
            all, may cost, in row-equivalents (chunked prefill, :meth:`~unmask.engine.request.Request.prefill_inputs`;
            a row at position p costs ``1 + p / P0``, P0 from the model's config:
            :func:`~unmask.engine.prefill_cost.attention_crossover_keys`); 0 = the whole prompt in the first step.
            :attr:`budget` holds both, and the prompt-tile alignment of chunk ends (a test may replace it).

    Raises:
        ValueError: ``compile`` on a model with packed weights (names ``compile``); ``prefill_chunk`` < 0.
    """

    def __init__(self, model: LoadedModel, compile: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self._chunk_waited = False  # the prompt budget left a chunk waiting in the last step
        self.budget = PrefillBudget(self.prefill_chunk, attention_crossover_keys(model.model.config),
                                    PROMPT_TILE if model.tiles_prompt_rows else 1)  # whole prompt tiles
        self.model = model
        self.device = model.device
        self.forbidden = torch.tensor(model.dllm.never_generate_ids, dtype=torch.long, device=self.device)
        self.forwards = 0  # batched forward passes run by this denoiser (engine-level NFE)
        self.compiled = bool(compile)
        if compile:
            model.enable_compile()

    @torch.inference_mode()
    def step(self, seqs: list[DecodingStrategy]) -> list[StepEvent]:
        """Run one denoising step for every sequence in ``seqs`` (none may be finished).

        The sequences' rows go through one forward, or a few when their chunks differ so much in length that
        padding them into one ``[B, Q]`` batch would waste most of its rows (a joining sequence's prompt prefill
        next to one-row decoding steps): see :func:`plan_forwards`. Results do not depend on the grouping
        (batch invariance).

        A sequence whose prompt rows still to forward before its first step cost more than ``prefill_chunk``
        row-equivalents (:attr:`budget`) forwards the next chunk of them instead (chunked prefill), so that a long
        prompt never holds up the others' steps for its whole prefill; it yields no event. A step's prompt rows,
        chunks and first steps' alike, cost at most ``prefill_chunk`` (always at least one sequence's): first steps
        cheapest first (a short request does not wait behind a long prefill), then chunks in arrival order, except
        after a step that left a chunk waiting, when chunks go first (no starvation); the others wait a step, their
        chunks unchanged.

        Returns:
            one :class:`StepEvent` per sequence that stepped, in order.
        """
        if not seqs:
            return []
        # decoding sequences (nothing pending) skip the chunked-prefill bookkeeping
        budget = self.budget
        pending = [seq.pending_prompt_rows() if budget.chunk else 0 for seq in seqs]
        chunks = [seq.prefill_inputs(budget) if p else None for seq, p in zip(seqs, pending)]
        costs = [sum(budget.cost(int(inp.chunk[0]), int(inp.chunk[-1]) + 1) for inp in c) if c is not None
                 else seq.pending_prompt_cost(budget) if p else 0 for seq, c, p in zip(seqs, chunks, pending)]
        # first steps cheapest first, then chunks in arrival order (a chunk counts as a whole budget: the first
        # prompt to join finishes its prefill first, and the next one can reuse it through the prefix cache)
        order = {i: c if chunks[i] is None else max(c, budget.chunk) for i, c in enumerate(costs) if c}
        # ... but after a step that left a chunk waiting, chunks go first (a stream of new first steps would
        # otherwise starve a long prompt for ever: break-it)
        starved = self._chunk_waited
        waiting, spent = set(), 0.0
        for i in sorted(order, key=lambda i: ((chunks[i] is None) == starved, order[i])):
            if spent and spent + costs[i] > budget.chunk:
                waiting.add(i)  # the step's prompt budget is spent: this sequence waits a step
            else:
                spent += costs[i]
        self._chunk_waited = any(chunks[i] is not None for i in waiting)
        keep = [i for i in range(len(seqs)) if i not in waiting]
        prefilling = [chunks[i] is not None for i in keep]
        inputs = [chunks[i] if chunks[i] is not None else seqs[i].lane_inputs() for i in keep]
        seqs = [seqs[i] for i in keep]
        events: list[StepEvent | None] = [None] * len(seqs)
        widths = [max(int(inp.chunk.numel()) for inp in lane_ins) for lane_ins in inputs]
        for group in plan_forwards(widths, [len(lane_ins) for lane_ins in inputs], self.forward_overhead_rows):
            for i, event in zip(group, self._step_group([seqs[i] for i in group], [inputs[i] for i in group],
                                                        [prefilling[i] for i in group])):
                events[i] = event
        return [e for e in events if e is not None]

    #: fixed cost of one batched forward, in padded rows (weight streaming, per-layer launches): the
    #: :func:`plan_forwards` cost model. On the 2-core CPU measured, a 1-row pass of the 30 layers' linears takes
    #: ~30 ms and each further row ~4 ms (``benchmarks/bench_gemm_rows.py``): ~8 rows; GPUs are higher.
    forward_overhead_rows = 16

    def _step_group(self, seqs: list[DecodingStrategy], inputs: list[list[LaneInput]], prefilling: list[bool]
                    ) -> list[StepEvent | None]:
        """One forward for ``seqs`` whose lane inputs (``inputs[i]`` for ``seqs[i]``) were already taken; a
        ``prefilling`` sequence's rows are a prompt chunk: committed as they are, no event (``None``), no NFE."""
        rows = [(seq, lane_index(inp, li), inp) for seq, lane_ins in zip(seqs, inputs)
                for li, inp in enumerate(lane_ins)]
        logits_by_row, kv = self._forward(rows)
        events = []
        r = 0
        for seq, lane_ins, prefill in zip(seqs, inputs, prefilling):
            n_lanes = len(lane_ins)
            if prefill:
                event, commits = None, [inp.commit for inp in lane_ins]
            else:
                seq.nfe += n_lanes
                event, commits = seq.consume(logits_by_row[r: r + n_lanes], self.forbidden)
            for li, (inp, commit) in enumerate(zip(lane_ins, commits)):
                if commit is not None and commit.numel():
                    commit = commit.to(self.device)
                    kv.commit(r + li, commit, seq.lanes[lane_index(inp, li)].cache, inp.chunk[commit],
                              inp.grp[commit])
            events.append(event)
            r += n_lanes
        return events

    def _forward(self, rows: list[tuple[DecodingStrategy, int, LaneInput]]
                 ) -> tuple[list[torch.Tensor], BatchKV]:
        """Batched forward; returns the ``[N_r, V]`` logits per row (needed outputs) and the forward's
        :class:`BatchKV` (for the commits)."""
        dev = self.device
        B = len(rows)
        Q = max(int(inp.chunk.numel()) for _, _, inp in rows)
        input_ids = torch.zeros(B, Q, dtype=torch.long, device=dev)
        pos = torch.zeros(B, Q, dtype=torch.long, device=dev)
        grp = torch.full((B, Q), -2, dtype=torch.long, device=dev)
        start = torch.zeros(B, Q, dtype=torch.long, device=dev)
        committed = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        valid = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        # committed prompt rows: a row-invariant decoder computes them in prompt tiles (engine/row_attention.py)
        prompt = torch.zeros(B, Q, dtype=torch.bool, device=dev) if self.model.tiles_prompt_rows else None
        # rows that run the model's row variant (today: a verifier for the causal rows of speculative requests)
        variant = torch.zeros(B, Q, dtype=torch.bool, device=dev) if self.model.has_row_variant else None
        # a mask-row adapter (engine/mask_adapter.py) runs on every non-committed row, whatever the strategy
        uncommitted = getattr(self.model.row_variant, "rows", None) == "uncommitted"
        lanes = []
        for b, (seq, li, inp) in enumerate(rows):
            n = int(inp.chunk.numel())
            input_ids[b, :n] = inp.tokens
            pos[b, :n] = inp.chunk
            grp[b, :n] = inp.grp
            start[b, :n] = inp.start
            committed[b, :n] = inp.committed
            valid[b, :n] = True
            if prompt is not None and (inp.replace_cache or seq.lanes[li].cache.length < seq.prompt_len):
                prompt[b, :n] = inp.committed & (inp.chunk < seq.prompt_len)  # (a decoding step has none)
            if variant is not None:
                rows_variant = ~inp.committed if uncommitted else seq.variant_rows(inp)
                if rows_variant is not None:
                    variant[b, :n] = rows_variant
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
        extra = {"prompt_rows": prompt} if prompt is not None and bool(prompt.any()) else {}  # decoding: no tiles
        hidden = self.model.hidden_states(input_ids, pos, mask, cache=kv, variant_rows=variant, **extra)
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
                                   variant_rows=variant[g_rows, g_cols] if variant is not None else None)

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
            if n_extra or carry_at >= 0:  # a copy: the sampler edits a step's rows in place (forbidden ids,
                # logit_bias), and a carry read again at a later step must be the model's output, not an edited row
                lane_cache.carry_logits = logits[off + (n_needed if n_extra else carry_at)].clone()
                lane_cache.carry_position = int(inp.chunk[inp.carry_index])
        return out, kv


def lane_index(inp: LaneInput, position: int) -> int:
    """The lane ``inp`` belongs to: its own ``lane`` when set (a prompt chunk of some lanes only), else its position
    in the sequence's list of lane inputs."""
    return position if inp.lane is None else inp.lane


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
