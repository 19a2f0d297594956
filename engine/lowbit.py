"""Weight-only int8 / int4 linear layers for the CPU (``--weights int8|int4``; docs/design.md#extensions-and-seams and
#scale-out).

The kernels are PyTorch's own weight-only CPU matrix products, called as gpt-fast calls them
(pytorch-labs/gpt-fast ``quantize.py``): ``torch.ops.aten._weight_int8pack_mm`` (int8 weights with one scale per
output channel) and ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (4-bit weights, asymmetric per group of
:data:`INT4_GROUP` input features, packed once by ``_convert_weight_to_int4pack_for_cpu``). Both take bfloat16
activations: with float32 activations the same ops ran 10-30x slower on the CPU measured (one 576x1536 layer, one
row: int8 68 us with bf16 vs 793 us with float32; int4 76 us vs 2185 us; fbgemm fp16 122 us;
``benchmarks/bench_lowbit.py`` measures them). So a layer computes ``y = float32(op(bf16(x))) + bias``: the input
is rounded to bfloat16 (relative 2^-9) and so is the output, on top of the weights' quantization error.

Chosen over torchao (0.18, its ``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig``), measured on the same layer:
torchao's int8 weight-only tensor ran 564 us (float32) / 1538 us (bf16) per call, and its version-2 int4 configs
have no CPU packing format (they need CUDA or the ``mslk`` package); the aten ops are what torchao's CPU layouts
call underneath, without the tensor-subclass dispatch.

Batch invariance (docs/design.md#decisions): the ops quantize nothing at run time (weight-only), so a row's output
does not depend on its batch mates (``tests/engine/test_lowbit.py`` checks it bit for bit across batch sizes).

CPU features: both kernels are ATen CPU kernels vectorised with ATen's ``Vectorized`` (AVX2 or AVX512 builds;
``torch.backends.cpu.get_cpu_capability()``); their bf16 arithmetic is fast with AVX512-BF16 (as on the CPU
measured) and correct but slower without it. :func:`lowbit_unavailable` says why a format cannot run (no such op in
this torch, not a CPU, a non-float32 model, no vectorised CPU capability); ``resolve_weight_format`` then falls
back to ``fp16`` packing (or ``native``) with a warning instead of failing.

Sources of quantization error, per format: ``int8`` = symmetric per output channel (absmax / 127) — the same grid
as bitsandbytes' LLM.int8() export, so an ``int8`` checkpoint runs on its own integers; ``int4`` = asymmetric per
group of 32 (gpt-fast's ``group_quantize_tensor``) of the dense weights (an nf4 checkpoint is dequantized and
re-quantized to this grid: another 4-bit grid, not nf4's). The LM head stays int8 in ``int4`` (its logits are the
decisions; a tied head gets its own copy).
"""
from __future__ import annotations

import torch
from torch import nn

#: input features per int4 group (gpt-fast's default is 128; 32 keeps the error nearer nf4's blocks of 64)
INT4_GROUP = 32
LOWBIT_FORMATS = ("int8", "int4")


def _has_aten_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def lowbit_unavailable(fmt: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``fmt`` (``int8`` | ``int4``) cannot run here, or None."""
    if device.type != "cpu":
        return f"it is a CPU format; this is {device.type}"
    if dtype != torch.float32:
        return f"it takes a float32 model; this one computes in {str(dtype).replace('torch.', '')}"
    ops = ["_weight_int8pack_mm"] if fmt == "int8" else ["_weight_int4pack_mm_for_cpu",
                                                         "_convert_weight_to_int4pack_for_cpu"]
    missing = [op for op in ops if not _has_aten_op(op)]
    if missing:
        return f"this torch ({torch.__version__}) has no aten.{missing[0]}"
    cap = torch.backends.cpu.get_cpu_capability()
    if not (cap.startswith("AVX") or cap in ("ZVECTOR", "VSX", "SVE256")):
        return f"this CPU has no vectorised ATen capability (get_cpu_capability() = {cap!r})"
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` float32 -> ``(q [out, in] int8, scales [out] float32)`` with
    ``weight ~= q * scales[:, None]`` (symmetric, absmax / 127 per output channel)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` float32 -> ``(q [out, in] int32 in 0..15, scales_and_zeros [in/group, out, 2])`` with
    ``weight ~= (q - 8) * scale + zero`` per group of ``group`` input features (gpt-fast's
    ``group_quantize_tensor``: min/max per group, zero stored at the grid's midpoint).

    Raises:
        ValueError: ``in`` is not a multiple of ``group``.
    """
    n, k = weight.shape
    if k % group:
        raise ValueError(f"weights: int4 needs in_features divisible by {group}, got {k}")
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6)
    zero = lo + scale * 8.0
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, scales_and_zeros)`` as :func:`quantize_int4` returns them when every group of :data:`INT4_GROUP` input
    features of ``weight`` ``[out, in]`` lies exactly (float32) on a uniform grid of at most 16 levels, ``lo + step *
    j`` with ``j`` in 0..15; None otherwise (and for shapes the kernel does not take). So int4 holds such weights
    losslessly up to the bfloat16 rounding of each group's scale and zero (relative 2^-9).

    The 4-bit blocks of GGUF files are such grids (llama.cpp ``ggml-quants.c``): Q4_1 ``d * q + m`` (both ends used:
    the min/max grid of :func:`quantize_int4`), Q4_0 ``d * (q - 8)`` and Q4_K's sub-blocks of 32 ``d * sc * q - dmin
    * m``, whose used levels need not span 0..15. A block using levels ``qmin..qmax`` lies on the grid of ``(max -
    min) / n`` for every multiple ``n`` of ``qmax - qmin``, and every span 1..15 has a multiple in 8..15: those eight
    grids are tried, each group keeping the first that fits. Float weights and Q8_0 / Q6_K blocks fit none.
    Reads the layer once per grid tried; allocates a few layer-sized temporaries.
    """
    if not int4_supported_shape(weight):
        return None
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    step = torch.zeros_like(lo)
    open_ = torch.ones_like(lo, dtype=torch.bool)
    for levels in range(15, 7, -1):
        idx = open_.nonzero(as_tuple=True)
        if not idx[0].numel():
            break
        g, base = groups[idx], lo[idx]
        size = ((hi[idx] - base) / levels).clamp(min=1e-6)
        j = torch.round((g - base[:, None]) / size[:, None])
        fits = ((base[:, None] + j * size[:, None] - g).abs() <= size[:, None] * 2.0 ** -12).all(dim=-1)
        step[idx[0][fits], idx[1][fits]] = size[fits]
        open_[idx[0][fits], idx[1][fits]] = False
        if levels == 15 and not fits[: k // INT4_GROUP].any():
            return None  # float weights: the first row fits nowhere, no use trying seven more grids
    if open_.any():
        return None
    q = torch.round((groups - lo[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([step, lo + step * 8.0], dim=-1).transpose(0, 1).contiguous()


def on_int4_grid(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[out, in]`` lies exactly on a 4-bit grid per group (:func:`int4_grid`): True for the
    dequantized linear layers of a Q4_0, Q4_1 or Q4_K GGUF, False for float weights and for finer grids (Q8_0, Q6_K).
    """
    return int4_grid(weight) is not None


def int4_supported_shape(weight: torch.Tensor) -> bool:
    """Whether the int4 kernel takes this ``[out, in]`` weight (in a multiple of the group, out of 8)."""
    n, k = weight.shape
    return k % INT4_GROUP == 0 and n % 8 == 0


class LowbitLinear(nn.Module):
    """``x @ weight.T + bias`` with int8 or int4 weights (see the module doc). Inference only.

    Args:
        weight: ``[out, in]`` float32. bias: ``[out]`` float32 or None. bits: 8 or 4. grid: int4's ``(q,
            scales_and_zeros)`` when the weights lie on a known 4-bit grid (:func:`int4_grid`), else min/max per group.
    Input ``[..., in]`` float32 -> output ``[..., out]`` float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"weights: bits must be 4 or 8, got {bits}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bits = bits
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if bits == 8:
            q, scales = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales.to(torch.bfloat16))
        else:
            q, sz = quantize_int4(weight) if grid is None else grid
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("scales", sz.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, INT4_GROUP, self.scales)
        y = y.float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def as_function(self):
        """``f(x) == self(x)`` (for the fused decoder's per-layer plans)."""
        return self.forward

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, ``[out, in]`` float32 (for tests and error budgets)."""
        eye = torch.eye(self.in_features)
        bias, self.bias = self.bias, None
        try:
            return self(eye).T.contiguous()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} weight-only"


def lowbit_linear(bits: int, head: bool = False):
    """A ``make_linear(weight, bias)`` factory for :func:`~unmask.engine.packed_weights.pack_model`: int ``bits``
    weights, int8 for the LM head (``head=True``) and for int4-incompatible shapes."""
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        b = 8 if head or (bits == 4 and not int4_supported_shape(weight)) else bits
        return LowbitLinear(weight, bias, b)

    return make


def grid_int4_linear(otherwise):
    """A ``make_linear(weight, bias)`` factory for the ``auto`` format of a model whose weights lie on a 4-bit grid
    (:func:`~unmask.engine.packed_weights.pack_model`): int4 for each layer :func:`on_int4_grid`, ``otherwise(weight,
    bias)`` (fp16 packing) for the rest, so no layer loses more than the bfloat16 rounding of the int4 scales or
    fp16's rounding. The built module records which (``.bits`` 4, or no ``bits`` for ``otherwise``)."""
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        grid = int4_grid(weight)
        return LowbitLinear(weight, bias, 4, grid=grid) if grid is not None else otherwise(weight, bias)

    return make
