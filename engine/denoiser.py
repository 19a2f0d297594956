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

from . import lane_masks
from .batch_step import batchable, consume_batch
from .config import OWN_FORWARD_FAMILIES
from .kv_cache import BatchKV, CarryPool
from .limits import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from .model import LoadedModel
from .outputs import StepEvent
from .plain_batch import all_table_ready, forward_rows, table_step
from .prefill_cost import PrefillBudget, attention_crossover_keys, forward_overhead_rows
from .request import DecodingStrategy, LaneInput
from .row_attention import PROMPT_TILE
from .step_graphs import StepGraphs, check_cuda_graphs
from .transfer import to_device
from .uniform_canvas import step_uniform


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
        cuda_graphs: run the batched reveal pass through :attr:`step_graphs` (bucketed static shapes, a CUDA graph
            per bucket captured at first use; ``unmask.engine.step_graphs``); CUDA devices only.

    Raises:
        ValueError: ``compile`` on a model with packed weights (names ``compile``); ``prefill_chunk`` < 0;
            ``cuda_graphs`` on a model that is not on a CUDA device (names ``cuda_graphs``).
    """

    #: plain cache-less sequences step as one table (engine/plain_batch.py); False: every sequence takes the general
    #: path (tests comparing the two, and recordings of the general path's consume)
    table_steps = True

    def __init__(self, model: LoadedModel, compile: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 cuda_graphs: bool = False):
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self._chunk_waited = False  # the prompt budget left a chunk waiting in the last step
        own = model.dllm.family in OWN_FORWARD_FAMILIES  # its own step (engine/uniform_canvas.py): no prompt chunks
        self.budget = PrefillBudget(self.prefill_chunk, 1 if own else attention_crossover_keys(model.model.config),
                                    PROMPT_TILE if model.tiles_prompt_rows else 1)  # whole prompt tiles
        self.model = model
        self.device = model.device
        self.forbidden = torch.tensor(model.dllm.never_generate_ids, dtype=torch.long, device=self.device)
        self.forwards = 0  # batched forward passes run by this denoiser (engine-level NFE)
        self.carry = CarryPool()  # every lane's carried logits, on the device
        self.forward_overhead_rows = forward_overhead_rows(model.model)  # plan_forwards' fixed cost of a forward
        self.encoder_store = None  # an encoder-decoder family's encoder KV reuse (engine/encoder_prefix.py)
        self.compiled = bool(compile)
        check_cuda_graphs(cuda_graphs, self.device)
        self.step_graphs = StepGraphs(self.device, capture=True) if cuda_graphs else None
        if cuda_graphs:
            self.table_steps = False  # the static step captures the general path's reveal pass
        self.table_memo: dict = {}  # their forward geometries (plain_batch._cached_geometry)
        self.table = None  # their canvases and log-probabilities (plain_batch.PlainTable)
        self.vocab_size = model.vocab_size
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
        if getattr(seqs[0], "own_forward", False):  # an encoder-decoder family's own step (engine/uniform_canvas.py)
            self.forwards += 1
            if self.step_graphs is not None:
                self.step_graphs.note_eager("uniform canvas", len(seqs))
            return step_uniform(self.model, seqs, self.encoder_store)
        if self.table_steps and all_table_ready(self, seqs, self.vocab_size):
            # every sequence a plain cache-less one: the table step (a mixed step keeps one forward for all)
            widths = [hi - lo for lo, hi, _, _ in map(forward_rows, seqs)]
            groups = plan_forwards(widths, [1] * len(seqs), self.forward_overhead_rows)
            return table_step(self, seqs, groups)
        return self._step_general(seqs)

    def _step_general(self, seqs: list[DecodingStrategy]) -> list[StepEvent]:
        """:meth:`step` through each sequence's lane inputs (what is not a table step)."""
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
        widths = [max(int(inp.chunk.numel()) for inp in lane_ins) for lane_ins in inputs]
        groups = plan_forwards(widths, [len(lane_ins) for lane_ins in inputs], self.forward_overhead_rows)
        events = self._step_groups(seqs, inputs, prefilling, groups)
        return [e for e in events if e is not None]


    def _step_groups(self, seqs: list[DecodingStrategy], inputs: list[list[LaneInput]], prefilling: list[bool],
                     groups: list[list[int]]) -> list[StepEvent | None]:
        """One forward per group of ``seqs`` (indices; ``inputs[i]``: the lane inputs ``seqs[i]`` took), then the
        step's reveals: unconstrained plain and multi-block sequences of every forward in one batched pass
        (``unmask.engine.batch_step``: one device-to-host copy for the whole step), the others (speculative,
        constrained) through their own ``consume``; then every lane's commits. A ``prefilling`` sequence's rows are
        a prompt chunk: committed as they are, no event (``None``), no NFE."""
        events: list[StepEvent | None] = [None] * len(seqs)
        commits = [[inp.commit for inp in lane_ins] for lane_ins in inputs]
        batched, batched_spans, pieces, kvs, offset = [], [], [], [], 0
        for group in groups:
            rows = [(seqs[i], lane_index(inp, li), inp) for i in group for li, inp in enumerate(inputs[i])]
            logits, spans, kv = self._forward(rows)
            r = 0
            for i in group:
                lane_spans, r = spans[r: r + len(inputs[i])], r + len(inputs[i])
                kvs.append((i, kv, r - len(inputs[i])))
                if prefilling[i]:
                    continue
                seqs[i].nfe += len(inputs[i])
                if batchable(seqs[i]):
                    batched.append(i)
                    batched_spans.append([(a + offset, b + offset) for a, b in lane_spans])
                else:
                    if self.step_graphs is not None:
                        self.step_graphs.note_eager("own consume")  # a grammar's, or a strategy's own
                    events[i], commits[i] = seqs[i].consume([logits[a:b] for a, b in lane_spans], self.forbidden)
            pieces.append(logits)
            offset += int(logits.shape[0])
        if batched:
            every = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            for i, (event, commit) in zip(batched, consume_batch([seqs[i] for i in batched], batched_spans, every,
                                                                 self.forbidden, self.step_graphs)):
                events[i], commits[i] = event, commit
        per_kv: dict[int, tuple[BatchKV, list]] = {}
        for i, kv, first in kvs:
            todo = per_kv.setdefault(id(kv), (kv, []))[1]
            for li, (inp, commit) in enumerate(zip(inputs[i], commits[i])):
                if commit is not None and commit.numel():
                    todo.append((first + li, commit, seqs[i].lanes[lane_index(inp, li)].cache, inp.chunk[commit],
                                 inp.grp[commit]))
        for kv, todo in per_kv.values():  # one batched copy per forward (BatchKV.commit_all)
            kv.commit_all(todo)
        return events

    def _forward(self, rows: list[tuple[DecodingStrategy, int, LaneInput]]
                 ) -> tuple[torch.Tensor, list[tuple[int, int]], BatchKV]:
        """Batched forward. Returns the needed rows' logits of every batch row, one after another (``[N, V]``, a
        tensor of its own: the sampler may edit it in place), each batch row's span ``(start, end)`` in it, and
        the forward's :class:`BatchKV` (for the commits). The inputs are assembled on the host (the requests'
        state is host state) and copied to the device in one tensor; the carried logits are read and written
        through the :class:`~unmask.engine.kv_cache.CarryPool` in one indexed op each."""
        dev = self.device
        lanes = []
        for seq, li, inp in rows:
            lane_cache = seq.lanes[li].cache
            if inp.replace_cache:
                lane_cache.reset()  # refilled by this forward: keep the buffers
            lanes.append(lane_cache)
        input_ids, pos, grp, start, committed, valid, prompt, variant, variant_host = self._inputs_on_device(rows)
        kv = BatchKV(lanes, dev)
        if self.model.lane_attention:  # each lane's keys read from its own buffer (engine/lane_attention.py)
            kv.lane_mode = True
            kv.rows = [int(inp.chunk.numel()) for _, _, inp in rows]
            kv.sees_all = [lane_masks.sees_every_key(inp, lane) for (_, _, inp), lane in zip(rows, lanes)]
        mask = lane_masks.forward_mask(kv, pos, grp, start, committed, valid)
        extra = {"prompt_rows": prompt} if prompt is not None else {}
        if variant is not None:  # the variant rows' indices are taken on the host (no device read)
            extra["variant_host"] = variant_host
        hidden = self.model.hidden_states(input_ids, pos, mask, cache=kv, variant_rows=variant, **extra)
        self.forwards += 1
        return (*self._gather_logits(rows, hidden, variant, variant_host), kv)

    def _inputs_on_device(self, rows: list[tuple[DecodingStrategy, int, LaneInput]]) -> tuple:
        """The forward's ``[B, Q]`` inputs (ids, positions, groups, group starts, committed, valid, prompt rows or
        None, variant rows or None), right-padded, built on the host and copied to the device in one tensor, and the
        variant rows' ``[B, Q]`` bool host copy (None without a row variant)."""
        pad = torch.nn.utils.rnn.pad_sequence
        inps = [inp for _, _, inp in rows]
        lengths = [int(inp.chunk.numel()) for inp in inps]
        B, Q = len(rows), max(lengths)
        longs = [pad([inp.tokens for inp in inps], batch_first=True),
                 pad([inp.chunk for inp in inps], batch_first=True),
                 pad([inp.grp for inp in inps], batch_first=True, padding_value=-2),
                 pad([inp.start for inp in inps], batch_first=True)]
        committed = pad([inp.committed for inp in inps], batch_first=True)
        valid = torch.arange(Q) < torch.tensor(lengths)[:, None]
        none = torch.zeros(B, Q, dtype=torch.bool)
        # committed prompt rows: a row-invariant decoder computes them in prompt tiles (engine/row_attention.py)
        prompt = none
        if self.model.tiles_prompt_rows:
            prompt = pad([inp.committed & (inp.chunk < seq.prompt_len)
                          if inp.replace_cache or seq.lanes[li].cache.length < seq.prompt_len  # (a step has none)
                          else torch.zeros(n, dtype=torch.bool) for (seq, li, inp), n in zip(rows, lengths)],
                         batch_first=True)
        variant = self.model.has_row_variant
        flag = none
        if variant:
            # a mask-row adapter (engine/mask_adapter.py) runs on every non-committed row, whatever the strategy
            uncommitted = getattr(self.model.row_variant, "rows", None) == "uncommitted"
            vs = [~inp.committed if uncommitted else seq.variant_rows(inp) for seq, _, inp in rows]
            flag = pad([torch.zeros(n, dtype=torch.bool) if v is None else v.cpu() for v, n in zip(vs, lengths)],
                       batch_first=True)
        host = torch.cat([torch.stack(longs), torch.stack([committed, valid, prompt, flag]).long()])  # [8, B, Q]
        on = to_device(host, self.device)
        any_prompt = bool(prompt.any())  # host values: no device read
        return (on[0], on[1], on[2], on[3], on[4].bool(), on[5].bool(), on[6].bool() if any_prompt else None,
                on[7].bool() if variant else None, flag if variant else None)

    def _gather_logits(self, rows: list[tuple[DecodingStrategy, int, LaneInput]], hidden: torch.Tensor,
                       variant: torch.Tensor | None, variant_host: torch.Tensor | None
                       ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The needed outputs of every row through one LM-head call, the carries (the last committed token's
        output, whose position is not forwarded again) read from and written to the pool; returns the logits of
        the needed rows in row order and each row's span."""
        dev = self.device
        g_rows, g_cols, spans = [], [], []  # LM-head inputs
        take, carry_dst, carry_src = [], [], []  # output row <- LM-head row; output row <- pool slot
        new_slots, new_src = [], []  # pool slot <- LM-head row (this step's carries)
        n_out = 0
        for b, (seq, li, inp) in enumerate(rows):
            needed = inp.needed.tolist()  # host
            lane_cache = seq.lanes[li].cache
            start_out = n_out
            carry_head = -1  # the LM-head row of the carry when it is also a needed row (block 1: the only one)
            for j in needed:
                if j >= 0:
                    if j == inp.carry_index:
                        carry_head = len(g_cols)
                    take.append((n_out, len(g_cols)))
                    g_rows.append(b)
                    g_cols.append(j)
                else:
                    carry_dst.append(n_out)
                    carry_src.append(lane_cache.carry_slot)
                n_out += 1
            spans.append((start_out, n_out))
            if inp.carry_index >= 0:
                new_slots.append(self.carry.slot(lane_cache))
                if carry_head < 0:
                    carry_head = len(g_cols)
                    g_rows.append(b)
                    g_cols.append(inp.carry_index)
                new_src.append(carry_head)
                lane_cache.carry_position = int(inp.chunk[inp.carry_index])
        idx = to_device(torch.tensor([g_rows, g_cols], dtype=torch.long), dev)
        extra = {} if variant is None else {"variant_host": variant_host[g_rows, g_cols]}
        head = self.model.logits(hidden[idx[0], idx[1]],
                                 variant_rows=variant[idx[0], idx[1]] if variant is not None else None, **extra)
        if not carry_dst and len(g_cols) == n_out:  # the LM-head rows are the needed rows, in order: no copy
            out = head
        else:
            plan = to_device(torch.tensor([[o for o, _ in take], [h for _, h in take]], dtype=torch.long).reshape(2, -1),
                             dev)
            out = head.new_empty(n_out, head.shape[-1])
            out[plan[0]] = head[plan[1]]
            if carry_dst:  # read before this step's carries overwrite the slots
                at = to_device(torch.tensor([carry_dst, carry_src], dtype=torch.long), dev)
                out[at[0]] = self.carry.rows[at[1]]
        if new_slots:  # copies (advanced indexing) before the sampler edits ``out`` in place
            self.carry.write(new_slots, head[to_device(torch.tensor(new_src, dtype=torch.long), dev)])
        return out, spans


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
    if n <= 1 or (overhead_rows > 0 and min(widths) == max(widths)):  # equal widths: a split only adds overheads
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
