"""A mixture-of-experts feed-forward layer (router, routed SwiGLU experts, shared experts), for any family that has
one (LLaDA2.x / LLaDA-MoE today; docs/design.md#model-families).

Routing (:class:`MoeRouter`, the DeepSeek-V3 / Ling / LLaDA2 rule): router logits ``x W^T`` in float32; scores =
``sigmoid`` (or ``softmax``) of them; the experts are chosen on ``scores + expert_bias`` (the bias only chooses,
it never weighs), limited to the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two best
experts); the weights are the chosen experts' plain scores, divided by their sum when ``norm_topk_prob`` (and
``top_k > 1``), times ``routed_scaling_factor``.

Experts (:class:`GroupedExperts`): the ``E`` experts' SwiGLU weights stacked (``gate_proj``/``up_proj``
``[E, I, H]``, ``down_proj`` ``[E, H, I]``). A forward sorts its (token, slot) pairs by expert and runs, on the
CPU, one gate, up and down GEMM per expert that received rows (a loop over the experts with rows, never over
tokens; the row counts read on the host), and where ``torch.nn.functional.grouped_mm`` has its kernel without a host
read (bf16 on CUDA compute capability 9.x/10.x, :func:`grouped_mm_reads_nothing`; the widths within its 16-byte
rule) one ``grouped_mm`` per projection over all of them with the group offsets on the device; each
pair's output lands in its own slot of a ``[N, k, H]`` buffer and the slots are summed in slot order, so a token's
result never depends on the order other tokens reached the experts. Batch invariance
(docs/design.md#exactness-contracts-by-device-and-dtype): routing is per row; an expert's GEMM row count is the
number of rows the batch sends it, and float32/bf16 GEMM kernels choose their blocking by row count, so a row's
output is batch-invariant within float32 (bf16) rounding, as for any dense linear layer, not bit for bit.

The interface a family uses: ``MoeLayer(MoeSpec(...))`` and ``layer(x)`` for ``x`` ``[..., H]``; parameters
``gate.weight`` ``[E, H]``, ``gate.expert_bias`` ``[E]`` (a buffer, zeros when the checkpoint has none),
``experts.{gate,up,down}_proj``, ``shared_experts.{gate,up,down}_proj.weight``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoeSpec", "MoeRouter", "GroupedExperts", "SwiGLU", "MoeLayer", "SCORE_FUNCTIONS", "grouped_mm_fits",
           "grouped_mm_reads_nothing"]

SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoeSpec:
    """The shape and routing rule of one MoE layer.

    Attributes:
        hidden: model width H. intermediate: one routed expert's width I.
        num_experts: E. top_k: experts per token. n_group / topk_group: group-limited routing (1 / 1 = off).
        score_function: ``sigmoid`` | ``softmax``. norm_topk_prob: renormalise the chosen weights.
        routed_scaling_factor: multiplies the routed weights. shared_intermediate: width of the shared experts'
            one SwiGLU (``moe_intermediate_size * num_shared_experts``; 0 = none).
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    score_function: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k} experts per token exceed num_experts {self.num_experts}")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide num_experts {self.num_experts}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: {self.topk_group} exceeds n_group {self.n_group}")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group: {self.topk_group} groups of {self.num_experts // self.n_group} experts "
                             f"hold fewer than top_k {self.top_k}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function: {self.score_function!r} is not one of {list(SCORE_FUNCTIONS)}")


class MoeRouter(nn.Module):
    """``x`` ``[N, H]`` -> ``(experts [N, k] int64, weights [N, k] float32)`` (module docstring's rule)."""

    def __init__(self, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden))
        self.register_buffer("expert_bias", torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits) if s.score_function == "sigmoid" else torch.softmax(logits, dim=-1)
        choose = scores + self.expert_bias.float()
        if s.n_group > 1 and s.topk_group < s.n_group:
            n = choose.shape[0]
            grouped = choose.view(n, s.n_group, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, n_group]
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(s.topk_group, dim=-1).indices, True)
            choose = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
        experts = choose.topk(s.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if s.norm_topk_prob and s.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * s.routed_scaling_factor


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with bias-free linear layers (a dense MLP or the shared experts)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """The routed experts, stacked; ``forward(x [N, H], experts [N, k], weights [N, k]) -> [N, H]`` (module
    docstring: one GEMM per expert with rows, slots summed in order)."""

    def __init__(self, spec: MoeSpec):
        super().__init__()
        E, I, H = spec.num_experts, spec.intermediate, spec.hidden
        self.gate_proj = nn.Parameter(torch.empty(E, I, H))
        self.up_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        sorted_rows = x.index_select(0, order // k)  # each pair's token, in expert order
        if grouped_mm_reads_nothing(sorted_rows.device, sorted_rows.dtype) and grouped_mm_fits(sorted_rows,
                                                                                                   self.gate_proj):
            out = self._grouped(sorted_rows, torch.bincount(flat, minlength=self.gate_proj.shape[0]))
        else:
            out = self._looped(sorted_rows, torch.bincount(flat, minlength=self.gate_proj.shape[0]).tolist())
        slots = torch.empty_like(out)
        slots[order] = out * weights.reshape(-1).to(x.dtype)[order, None]
        return slots.view(N, k, out.shape[-1]).sum(dim=1)  # the width named: N may be 0

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One ``grouped_mm`` per projection over ``rows`` ``[P, H]`` sorted by expert (``counts`` ``[E]`` on the
        rows' device): the group offsets stay on the device, so no host read. Only where
        :func:`grouped_mm_reads_nothing`: on the CPU the kernel's bits differ from the loop's (float32 rounding),
        which the llada2 checks were made with, and a host read costs nothing there; elsewhere on a GPU torch's
        fallback reads the offsets on the host once per call."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = F.silu(F.grouped_mm(rows, self.gate_proj.transpose(1, 2), offs=offs)) * \
            F.grouped_mm(rows, self.up_proj.transpose(1, 2), offs=offs)
        return F.grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)

    def _looped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One gate, up and down GEMM per expert with rows (``counts`` read on the host)."""
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            chunk = rows[start:start + count]
            h = F.silu(chunk @ self.gate_proj[e].t()) * (chunk @ self.up_proj[e].t())
            out[start:start + count] = h @ self.down_proj[e].t()
            start += count
        return out


def grouped_mm_reads_nothing(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs a kernel with no host read on ``device`` for ``dtype``:
    bfloat16 on a CUDA GPU of compute capability 9.x or 10.x (torch's ``_grouped_mm_cuda`` fast path; torch built
    against CUDA >= 13.3 also runs fp16 there through cuBLASLt, not assumed here). Anything else takes torch's
    fallback, which reads the offsets on the host (``offs.cpu()``) and runs one GEMM per group, empty ones included:
    three host reads per MoE layer where the per-expert loop reads its counts once."""
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_properties(device).major in (9, 10)


def grouped_mm_fits(rows: torch.Tensor, stacked: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes these operands (torch >= 2.10): same dtype, and every
    row of both a multiple of 16 bytes (the kernel's stride rule; ``stacked`` ``[E, I, H]``)."""
    size = rows.element_size()
    return (hasattr(F, "grouped_mm") and rows.dtype == stacked.dtype and rows.dim() == 2
            and (stacked.shape[1] * size) % 16 == 0 and (stacked.shape[2] * size) % 16 == 0)


class MoeLayer(nn.Module):
    """Router + routed experts + shared experts: ``[..., H]`` -> ``[..., H]`` (module docstring)."""

    def __init__(self, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.gate = MoeRouter(spec)
        self.experts = GroupedExperts(spec)
        self.shared_experts = SwiGLU(spec.hidden, spec.shared_intermediate) if spec.shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self.gate(flat)
        out = self.experts(flat, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
