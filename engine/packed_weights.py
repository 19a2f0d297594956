"""CPU weight formats at run time: the linear layers of a loaded model repacked for fbgemm's fp16 GEMM.

On a CPU, a decoding step is a handful of rows (1 for AR-equivalent decoding, up to ~20 for a speculative step)
against every weight matrix. MKL's float32 GEMM handles such skinny products poorly on the CPUs measured (on the
2-core AMD EPYC of the benchmarks, 2-4 rows cost ~1.6x one row and 20 rows 2x; ``benchmarks/bench_gemm_rows.py
--formats fp32,fp16,int8``), while fbgemm's packed fp16 kernels read half the bytes and keep small row counts
cheap: the seven linear layers of SmolLM2-135M run 1.6x (1 row) to 2.4x (2-4 rows) faster. This module swaps every
linear layer (``nn.Linear`` and bitsandbytes' ``Linear4bit``/``Linear8bitLt``, dequantized first) for
:class:`PackedFp16Linear` (the kernel of ``torch.ao.nn.quantized.dynamic.Linear`` with fp16 weights): activations and accumulation stay float32, so a row's
result does not depend on the other rows of the batch beyond float32 rounding (the batch invariance of
docs/design.md#decisions holds as with MKL), and the weights move by fp16 rounding only (relative ~2^-11, far below
nf4's quantization error). fbgemm's int8 dynamic linears would be faster still, but they quantize activations per
tensor, i.e. over the whole batch, so a request's tokens would depend on its batch mates: not offered.

The seam: :func:`pack_model` is the one entry point (``load_model(weights=...)`` calls it once); it also installs the
fused decoder forward (:mod:`unmask.engine.fused_decoder`) on Llama-architecture models
(docs/design.md#extensions-and-seams).

Formats: ``native`` (the weights as loaded), ``fp16`` (packed as above; float32 models on a CPU with fbgemm only),
``auto`` (``fp16`` for a float32 model on a CPU whose torch build has fbgemm, else ``native``; but ``int4`` when
the weights lie on a 4-bit grid of 32, as a Q4_1 GGUF's do: see below), ``int8`` / ``int4`` (weight-only low-bit
kernels, :mod:`unmask.engine.lowbit`; where they cannot run, the ``auto`` choice with a warning).

``auto`` on a 4-bit GGUF's weights (the default model, converted from ``SmolLM2-135M-Instruct.Q4_1.gguf``): the
checkpoint holds the GGUF's blocks dequantized (``d * q + m`` per 32 weights), so fp16 packing would read 4x the
bytes of information the weights have. When the first decoder layer lies on int4's grid
(:func:`unmask.engine.lowbit.on_int4_grid`, an exact test), every layer on the grid runs int4 holding those same
blocks (only each block's scale and zero are rounded to bfloat16), every other layer (the LM head, Q8_0 in that
GGUF) fp16-packed; ``loaded.packed_layers`` counts them. The fused decoder then runs row-invariant attention
(:mod:`unmask.engine.row_attention`), as for ``int8``/``int4``. ``--weights fp16`` keeps the dequantized fp16 path.

Memory: a packed layer holds fp16 weights (2 bytes per parameter: 4x an nf4 checkpoint's 0.5, half of float32); a
tied LM head gets its own fp16 copy next to the float32 input embedding.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .fused_decoder import dense_weight  # the lower layer: packing uses fusing, never the reverse
from .heap import return_freed_memory


WEIGHT_FORMATS = ("auto", "native", "fp16", "int8", "int4")


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm's packed kernels (x86 builds; not ARM)."""
    engines = getattr(torch.backends.quantized, "supported_engines", [])
    return "fbgemm" in engines or "x86" in engines


def resolve_weight_format(fmt: str | None, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """``auto`` -> ``fp16`` for a float32 model on a CPU with fbgemm, else ``native`` (:func:`pack_model` may still
    take ``auto``'s int4 case, which reads the weights).

    Raises:
        ValueError: (names ``weights``) an unknown format, or ``fp16`` on a non-CPU device, without fbgemm, or with
            a compute dtype other than float32 (the packed kernels take float32 activations).
    """
    fmt = fmt or "auto"
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights: {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if fmt in ("int8", "int4"):
        from .lowbit import lowbit_unavailable

        why_low = lowbit_unavailable(fmt, device, dtype)
        if why_low is None:
            return fmt
        fallback = resolve_weight_format("auto", device, dtype)
        warnings.warn(f"weights: {fmt} cannot run here ({why_low}); using {fallback}", RuntimeWarning, stacklevel=2)
        return fallback
    why = None
    if device.type != "cpu":
        why = f"only on a CPU; this is {device.type}"
    elif not fbgemm_available():
        why = "only with fbgemm (x86 torch builds); this torch has none"
    elif dtype != torch.float32:
        why = f"only with float32 activations; the model computes in {str(dtype).replace('torch.', '')}"
    if fmt == "auto":
        return "native" if why else "fp16"
    if fmt == "fp16" and why:
        raise ValueError(f"weights: fp16 packing is a CPU format (fbgemm) and works {why}; use --weights native")
    return fmt


class PackedFp16Linear(nn.Module):
    """``x @ weight.T + bias`` through fbgemm's fp16 GEMM (``quantized::linear_dynamic_fp16``): weights packed once
    as fp16 (values beyond fp16's range saturate), activations, accumulation and output float32.

    The same kernel as ``torch.ao.nn.quantized.dynamic.Linear(dtype=torch.float16)``, called through the operator
    overload directly: that module's Python dispatch cost ~27 us per call, a tenth of a one-row decoding step of
    SmolLM2-135M (121 calls).

    Args:
        weight: ``[out, in]`` float32. bias: ``[out]`` float32 or None.
    Input ``[..., in]`` float32 -> output ``[..., out]`` float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.has_bias = bias is not None
        with warnings.catch_warnings():  # fbgemm's saturation notice for out-of-range weights
            warnings.simplefilter("ignore")
            self._packed = torch.ops.quantized.linear_prepack_fp16(
                weight.detach().float().contiguous(), None if bias is None else bias.detach().float().contiguous())
        overload = torch.ops.quantized.linear_dynamic_fp16.default
        # the C++ entry point behind the overload (skips its Python-side dispatch checks); the overload if absent
        self._op = getattr(overload, "_op", overload)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self._packed)

    def as_function(self):
        """``f(x) == self(x)`` without ``nn.Module`` call overhead (for per-layer plans)."""
        op, packed = self._op, self._packed
        return lambda x: op(x, packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, fp16 fbgemm"


def fp16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A :class:`PackedFp16Linear` computing ``x @ weight.T + bias`` (``weight`` ``[out, in]`` float32)."""
    return PackedFp16Linear(weight, bias)


def pack_linears_fp16(model: nn.Module, make_linear=None) -> int:
    """Replace, in place, every linear layer under ``model`` (including those inside routed modules) by an fbgemm
    fp16 linear; the module that held it (tied LM head included) gets its own packed copy, embeddings and norms stay
    as they are. Returns the number of layers packed. Inference only: packed layers have no gradients.
    ``make_linear(weight, bias)``: another packed layer to build (default :func:`fp16_linear`; the low-bit formats).

    Raises:
        ValueError: (names ``weights``) a bitsandbytes layer that cannot be dequantized, or one left unpacked.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            dense = dense_weight(child)
            if dense is None:
                continue
            setattr(parent, name, (make_linear or fp16_linear)(*dense))
            count += 1
    left = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")})
    if left:
        raise ValueError(f"weights: {', '.join(left)} layers were left unpacked")
    return count


def pack_model(loaded, weight_format: str) -> None:
    """Run the linear layers of ``loaded`` (a :class:`~unmask.engine.model.LoadedModel`, any row variant attached
    already) in ``weight_format`` (``auto`` | ``native`` | ``fp16`` | ``int8`` | ``int4``); once per model.
    Inference only. The low-bit formats build :class:`~unmask.engine.lowbit.LowbitLinear` layers the same way
    (fused projections included).

    ``auto`` packs as :func:`resolve_weight_format` says, or in its int4 case (the module docstring) when the
    first decoder layer's weights lie on the int4 grid.

    For ``fp16``: q|k|v and gate|up become one packed GEMM each (:func:`~unmask.engine.fused_decoder.fuse_projections`,
    layer by layer), every other linear is packed, and Llama-architecture decoders get
    ``loaded.decoder_forward`` = a :class:`~unmask.engine.fused_decoder.FusedDecoder` (row-invariant attention for
    int8/int4, docs/design.md#decisions). ``native`` (or the format
    already in place) changes nothing.

    Raises:
        ValueError: (names ``weights``) an unknown format or one this device cannot run; packing twice.
    """
    from .fused_decoder import FusedDecoder, fuse_projections

    fmt = resolve_weight_format(weight_format, loaded.device, loaded.dtype)
    on_grid = (weight_format or "auto") == "auto" and fmt == "fp16" and _first_layer_on_int4_grid(loaded)
    if on_grid:
        fmt = "int4"  # the auto rule's int4 case: the weights are a 4-bit GGUF's (docs/design.md#extensions-and-seams)
    if fmt == loaded.weight_format:
        return
    if loaded.weight_format != "native":
        raise ValueError(f"weights: the linear layers are already packed as {loaded.weight_format}; load the "
                         f"checkpoint again for {fmt}")
    decoder = loaded.model.base_model
    make_linear = fp16_linear
    if on_grid:
        from .lowbit import grid_int4_linear

        make_linear = grid_int4_linear(fp16_linear)  # int4 where a layer is on the grid, fp16 elsewhere (the head)
    elif fmt in ("int8", "int4"):
        from .lowbit import lowbit_linear

        make_linear = lowbit_linear(8 if fmt == "int8" else 4)
        head = dense_weight(loaded.model.get_output_embeddings())
        if head is not None:  # the LM head: int8 in both low-bit formats (a tied head gets its own copy)
            loaded.model.set_output_embeddings(lowbit_linear(8, head=True)(*head))
    make_linear = _returning_freed_memory(make_linear)
    fused = fuse_projections(decoder, make_linear=make_linear)
    pack_linears_fp16(loaded.model, make_linear)
    loaded.refresh_head()
    loaded.weight_format = fmt
    loaded.packed_layers = _count_formats(loaded.model)
    loaded.decoder_forward = FusedDecoder(decoder, row_invariant=fmt in ("int8", "int4")) if fused else None
    return_freed_memory()


def _first_layer_on_int4_grid(loaded) -> bool:
    """Whether int4 can run here and the first linear layer of the first decoder layer lies on the int4 grid
    (:func:`unmask.engine.lowbit.on_int4_grid`): the probe of ``auto``'s int4 case (one layer read)."""
    from .lowbit import lowbit_unavailable, on_int4_grid

    if lowbit_unavailable("int4", loaded.device, loaded.dtype) is not None:
        return False
    layers = getattr(loaded.model.base_model, "layers", None)
    if not layers:
        return False
    for module in layers[0].modules():
        dense = dense_weight(module)
        if dense is not None:
            return on_int4_grid(dense[0])
    return False


def _count_formats(model: nn.Module) -> dict[str, int]:
    """``{format: packed linear layers}`` under ``model`` (``fp16``, ``int8``, ``int4``; fused projections count
    once, the LM head included)."""
    from .lowbit import LowbitLinear

    counts: dict[str, int] = {}
    for m in model.modules():
        kind = (f"int{m.bits}" if isinstance(m, LowbitLinear) else "fp16" if isinstance(m, PackedFp16Linear)
                else None)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _returning_freed_memory(make_linear):
    """``make_linear`` that first returns what the layers replaced so far freed (:func:`return_freed_memory`)."""
    def make(weight, bias):
        return_freed_memory()
        return make_linear(weight, bias)

    return make
