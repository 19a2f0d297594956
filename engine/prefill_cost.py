"""What a prompt chunk costs (docs/design.md#decoding, "Chunked prefill"): prompt rows in row-equivalents.

A prompt row runs the decoder's linear layers, the same work at any position, and attends to every key before it,
work that grows with its position: a 256-row chunk of SmolLM2-135M took 0.46 s at the start of a 6000-token prompt
and 1.74 s at its end (int4, 2 threads). Counting a row at position ``p`` as ``1 + p / P0`` row-equivalents, where
``P0`` (:func:`attention_crossover_keys`) is the key count at which a row's attention costs what its linear layers
cost, bounds a chunk (and a step's prompt rows) by its cost rather than by its rows: chunks shrink as the prompt
goes on, and the other streams' longest wait no longer grows with the prompt's length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def attention_crossover_keys(config) -> float:
    """``P0``: the keys at which one row's attention FLOPs equal its linear-layer FLOPs, from a transformers config
    (``hidden_size`` H, ``intermediate_size`` I, ``num_hidden_layers`` L, ``num_attention_heads`` Hq,
    ``num_key_value_heads`` Hkv, default Hq, ``head_dim`` D, default H / Hq).

    Per row and forward, a multiply-add counted as 2 FLOPs:

    * linear layers: ``2 * N_linear``, ``N_linear = L * (H*Hq*D + 2*H*Hkv*D + Hq*D*H + 3*H*I)``: the q, k, v and o
      projections and the gated MLP's gate, up and down (the decoder's linear layers; a prompt row runs no LM head,
      and the embedding is a lookup);
    * attention: per key ``4 * Hq * D * L``: ``q . k`` and ``w * v`` over D in each head of each layer;

    so ``P0 = 2 * N_linear / (4 * Hq * D * L)``. SmolLM2-135M (H 576, I 1536, L 30, Hq 9, Hkv 3, D 64):
    ``N_linear`` = 106,168,320, ``P0`` = 3072; the tests' tiny Llama (H 64, I 128, L 2, Hq 4, Hkv 2, D 16): 288.

    Raises:
        ValueError: a key is missing or not a positive integer (names it).
    """
    def key(name: str, default: int | None = None) -> int:
        value = getattr(config, name, None)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model config: {name} must be a positive integer to size prefill chunks, got {value!r}")
        return value

    H, I, L, Hq = key("hidden_size"), key("intermediate_size"), key("num_hidden_layers"), key("num_attention_heads")
    Hkv, D = key("num_key_value_heads", Hq), key("head_dim", H // Hq)
    n_linear = L * (H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 3 * H * I)
    return 2 * n_linear / (4 * Hq * D * L)


@dataclass(frozen=True)
class PrefillBudget:
    """The bound of a prompt chunk and of a step's prompt rows, in row-equivalents: a row at position ``p`` costs
    ``1 + p / keys``.

    Attributes:
        chunk: row-equivalents per chunk and per step (``prefill_chunk``: rows at the prompt's start; 0 = chunked
            prefill off).
        keys: ``P0`` (:func:`attention_crossover_keys`); ``math.inf`` counts every row as 1 (a bound on rows).
        align: a chunk ends on a multiple of this when one lies past its start (``PROMPT_TILE`` under
            row-invariant attention: a prompt tile cut by a chunk's end runs its attention call in both chunks;
            unaligned chunks of 256 spent 1.3x the attention a 6000-token prompt needs; 1 = anywhere).
    """

    chunk: float
    keys: float = math.inf
    align: int = 1

    def cost(self, start: int, end: int) -> float:
        """Row-equivalents of the positions ``[start, end)`` (0 when empty): ``n + (start * n + n(n-1)/2) / keys``."""
        n = max(0, end - start)
        return n + (start * n + n * (n - 1) // 2) / self.keys

    def end(self, start: int, limit: int) -> int:
        """The end of a chunk from ``start``: the largest ``e <= limit`` whose rows ``[start, e)`` cost at most
        :attr:`chunk`, at least ``start + 1`` (one row whatever it costs), then rounded down to a multiple of
        :attr:`align` when it holds at least :attr:`align` rows (``limit`` is never rounded); ``limit`` when
        ``start >= limit``."""
        if start >= limit:
            return limit
        lo, hi = 1, limit - start  # rows: lo always taken; the cost grows with the rows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost(start, start + mid) <= self.chunk:
                lo = mid
            else:
                hi = mid - 1
        end = start + lo
        aligned = end // self.align * self.align
        # only a chunk holding a whole tile is cut back to one: shorter ones would split every tile in two chunks
        return aligned if end < limit and end - start >= self.align else end


#: a forward's fixed host work per decoder layer (launches, Python) in the FLOPs of row work it costs as much as:
#: measured on the 2-core CPU (1 thread), the tiny LLaDA2 replica (3 layers, 0.21M parameters) forwards 1 x 32 rows
#: in 3.7 ms, 8 x 32 in 5.9, 8 x 64 in 8.6 (~1.2 ms a layer fixed, ~0.01 ms a row: ~4e10 FLOP/s)
HOST_FLOPS_PER_LAYER = 5e7


def forward_overhead_rows(module) -> int:
    """The fixed cost of one batched forward of ``module`` (the loaded ``nn.Module``, with a ``config``) in padded
    rows, ``unmask.engine.denoiser.plan_forwards``' cost model: 16 for weight streaming (on the 2-core CPU measured a 1-row pass of SmolLM2's 30 layers' linears takes ~30 ms and each further
    row ~4 ms, ``benchmarks/bench_gemm_rows.py``: ~8 rows) plus the host's per-layer work over a row's FLOPs (2 per
    parameter): ``L * HOST_FLOPS_PER_LAYER / (2 N)``. ~22 rows for SmolLM2-135M, 16 for billion-parameter models,
    several hundred for the tests' tiny models, whose padded rows cost next to nothing (splitting their batch into
    several forwards made a step slower)."""
    config = getattr(module.config, "text_config", None) or module.config
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    own = {id(p) for p in module.parameters()}
    params = sum(p.numel() for p in module.parameters())
    for m in module.modules():  # packed / low-bit linears keep their weights in buffers: counted by their shape
        if id(getattr(m, "weight", None)) not in own and hasattr(m, "in_features") and hasattr(m, "out_features"):
            params += int(m.in_features) * int(m.out_features)
    return int(16 + layers * HOST_FLOPS_PER_LAYER / (2 * max(1, params)))
