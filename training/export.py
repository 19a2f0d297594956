"""Export a trained checkpoint as a servable (optionally bitsandbytes-quantized) checkpoint (docs/design.md#checkpoints
and #decisions).

``export(src, out, quantization)``: ``src`` is a servable directory or a training ``OUT`` (its ``latest``
checkpoint). Training checkpoints already hold the LoRA adapters merged into the full-precision base (never into
dequantized NF4 weights, docs/design.md#decisions), so export loads full-precision weights, quantizes them with
bitsandbytes (``nf4`` = 4-bit NormalFloat with float32 compute on CPU / bf16 on CUDA, ``int8`` = LLM.int8(),
``none`` = plain copy in ``dtype``) and writes the result with ``write_checkpoint`` (atomic; the
``quantization_config`` goes into ``config.json``).

The bitsandbytes 0.50 trap: on CPUs with AVX512-BF16 the first CPU forward of a 4-bit module repacks its weights in
place, and saving or moving the module afterwards writes different weights. Export therefore quantizes into a
fresh model straight from the full-precision files, guards it with a forward hook, and refuses to write a model that
has run a forward (:class:`ExportError`). Only after the files are written does it run its own forward (the
"exporter's logits") and compare them with a reload of the written checkpoint (``verify``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from unmask.engine.checkpoint import (mark_temporary, publish_directory, remove_stale_temporaries, unique_suffix,
                                     write_checkpoint)

from .convert import ConversionError, resolve_source

QUANTIZATIONS = ("none", "nf4", "int8")
VERIFIER_DIR = "verifier"  # where an export places the source's verifier (named relatively in dllm.verifier)


class ExportError(RuntimeError):
    """Bad source/output, or a quantized model that ran a forward was about to be written."""


def quantization_config(quantization: str, device: torch.device):
    """The transformers ``BitsAndBytesConfig`` for ``nf4`` / ``int8`` (None for ``none``)."""
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def _guard(model) -> None:
    """Flag ``model._unmask_ran_forward`` on its first forward (the repack trap makes such a module unsafe to save)."""
    model._unmask_ran_forward = False

    def hook(module, args, kwargs):
        module._unmask_ran_forward = True

    model.register_forward_pre_hook(hook, with_kwargs=True)


def load_quantized_fresh(src: Path, quantization: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Quantize the full-precision weights of ``src`` into a fresh model that has never run a forward (guarded)."""
    from transformers import AutoModelForCausalLM

    qc = quantization_config(quantization, device)
    if qc is None:
        model = AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="sdpa", dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="sdpa", dtype=dtype,
                                                     quantization_config=qc, device_map={"": str(device)})
    model.eval()
    _guard(model)
    return model


def probe_ids(tokenizer, n: int = 16) -> torch.Tensor:
    """A fixed ``[1, n]`` probe input for the logits comparison."""
    ids = tokenizer("The quick brown fox jumps over the lazy dog. 1 2 3", add_special_tokens=False).input_ids
    ids = (ids * (n // max(len(ids), 1) + 1))[:n]
    return torch.tensor([ids], dtype=torch.long)


def export(src: str | os.PathLike, out: str | os.PathLike, quantization: str = "nf4", device: str = "cpu",
           dtype: str = "float32", verify: bool = True, overwrite: bool = False,
           default_threshold: float | None = None, default_speculative: bool | None = None,
           keep_verifier: bool = True, clear_default_threshold: bool = False,
           verifier_quantization: str | None = None) -> dict:
    """Write ``out``: the checkpoint of ``src`` quantized with ``quantization``.

    Args:
        src: servable directory or training OUT. out: new directory (must not exist or be empty).
        quantization: ``none`` | ``nf4`` | ``int8``. device: where to quantize (``cpu`` or ``cuda``).
        dtype: dtype of the non-quantized tensors (``float32`` | ``bfloat16`` | ``float16``).
        verify: after writing, compare the exporter's logits with a reload of ``out`` (max abs difference).
        default_threshold: written as ``dllm.default_sampling.threshold``: requests that set neither ``steps`` nor
            ``threshold`` then decode with confidence-threshold parallel decoding at this value (None = keep the
            source's defaults).
        default_speculative: written as ``dllm.default_sampling.speculative``: requests that do not set
            ``speculative`` (and fit it) then decode self-speculatively (None = keep the source's defaults).
        verifier_quantization: quantization of the exported verifier (None = ``none``: the verifier - whose greedy
            tokens are the answers of speculative requests - stays exact; nf4 re-quantization of SmolLM2-135M moves
            its answers to token F1 0.46 against the full-precision parent's; int8 (LLM.int8) picks outlier
            columns per call, so its rows depend on the other rows and the output on the batch).
        clear_default_threshold: drop the source's ``dllm.default_sampling.threshold`` (requests without
            ``steps``/``threshold`` then decode one token per step); exclusive with ``default_threshold``.
        keep_verifier: when the source names a verifier (``dllm.verifier``, ``unmask.engine.routed``), export it
            too - quantized the same way, into ``out/verifier`` - and name it relatively, so that ``out`` is
            self-contained; False drops the verifier (speculative requests then verify with the model's own
            causal path).

    Returns:
        ``{"out", "source", "quantization", "max_abs_logit_diff", "verifier"}`` (the diff is None without
        ``verify``; ``verifier``: the exported verifier's source, or None).

    Raises:
        ExportError: bad arguments/source, a quantized source, or a reload whose logits differ from the
            exporter's by more than 1e-4.
    """
    from unmask.engine.families.common import load_tokenizer

    if verifier_quantization is None:
        verifier_quantization = "none"
    dev, dt = _device_and_dtype(quantization, verifier_quantization, device, dtype)
    srcp, cfg, outp = _source_and_out(src, out, overwrite)
    dllm = _exported_dllm(srcp, cfg, default_threshold, default_speculative, clear_default_threshold)
    vsrc, vdllm = _verifier(srcp, dllm, keep_verifier)
    tok = load_tokenizer(srcp)
    model = load_quantized_fresh(srcp, quantization, dev, dt)
    # written and checked under a staging name; `out` only ever holds a verified export
    staging = outp.parent / f"{outp.name}.verify-{unique_suffix()}"
    remove_stale_temporaries(outp)  # a staging directory of a killed export
    if staging.exists():
        shutil.rmtree(staging)
    diff = None
    try:
        write_quantized(staging, model, tok, dllm)
        mark_temporary(staging)
        from unmask.engine.adapter_files import record_export

        # the source's hash: its adapters apply here (docs/design.md#mask-row-adapter)
        record_export(staging, srcp, quantization)
        if vsrc is not None:
            vmodel = load_quantized_fresh(vsrc, verifier_quantization, dev, dt)
            write_quantized(staging / VERIFIER_DIR, vmodel, load_tokenizer(vsrc), vdllm)
            if verify:
                _check_reload(vmodel, staging / VERIFIER_DIR, outp / VERIFIER_DIR, dev, dt, tok)
        if verify:
            diff = _check_reload(model, staging, outp, dev, dt, tok)
        publish_directory(staging, outp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"out": str(outp), "source": str(srcp), "quantization": quantization, "max_abs_logit_diff": diff,
            "verifier": None if vsrc is None else str(vsrc),
            "verifier_quantization": None if vsrc is None else verifier_quantization}


def write_quantized(out: Path, model, tokenizer, dllm, overwrite: bool = False) -> Path:
    """``write_checkpoint`` for a model built by :func:`load_quantized_fresh`.

    Raises:
        ExportError: the model has run a forward (bitsandbytes may have repacked its 4-bit weights in place).
    """
    if getattr(model, "_unmask_ran_forward", True):
        raise ExportError("refusing to write a model that has run a forward (or was not built by "
                          "load_quantized_fresh): bitsandbytes may have repacked its weights; quantize afresh")
    return write_checkpoint(out, model, tokenizer, dllm, overwrite=overwrite)


@torch.no_grad()
def verify_export(model, out: Path, device: torch.device, dtype: torch.dtype, tokenizer) -> float:
    """Max abs difference between the exporter's logits on a probe and those of ``out`` reloaded by the engine."""
    from unmask.engine.model import load_model

    ids = probe_ids(tokenizer)
    mine = model(input_ids=ids.to(model.device)).logits.float().cpu()
    lm = load_model(out, device=str(device), dtype=str(dtype).replace("torch.", ""), weights="native")
    theirs = lm.model(input_ids=ids.to(lm.device)).logits.float().cpu()
    del lm
    return float((mine - theirs).abs().max())


def _device_and_dtype(quantization: str, verifier_quantization: str, device: str, dtype: str):
    """The export's device and dtype, with the quantization names checked (:func:`export`'s arguments)."""
    from unmask.engine.model import resolve_device, resolve_dtype

    if quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization: {quantization!r} is not one of {QUANTIZATIONS}")
    if verifier_quantization not in QUANTIZATIONS:
        raise ExportError(f"--verifier-quantization: {verifier_quantization!r} is not one of {QUANTIZATIONS}")
    try:
        dev = resolve_device(device)
    except ValueError as exc:
        raise ExportError(f"--{exc}") from exc
    if quantization != "none" and dev.type not in ("cpu", "cuda"):
        raise ExportError(f"--device: bitsandbytes quantization runs on cpu or cuda, got {device}")
    try:
        return dev, resolve_dtype(dtype, dev)
    except ValueError as exc:
        raise ExportError(f"--dtype: {exc}") from exc


def _source_and_out(src, out, overwrite: bool) -> tuple[Path, dict, Path]:
    """``(source checkpoint, its config.json, out)``: a training OUT is its latest checkpoint; the source must be
    a full-precision a2d checkpoint and ``out`` new or empty (or ``overwrite``)."""
    from unmask.engine.model import read_config

    srcp = Path(src)
    if not ((srcp / "latest").is_file() or (srcp / "config.json").is_file()):
        raise ExportError(f"{srcp}: neither a checkpoint directory (config.json) nor a training output (latest)")
    try:
        srcp, _ = resolve_source(srcp)  # a training OUT -> its latest checkpoint
    except ConversionError as exc:
        raise ExportError(str(exc)) from exc
    cfg = read_config(srcp)
    if isinstance(cfg.get("quantization_config"), dict):
        raise ExportError(f"{srcp}: is already quantized; export from the full-precision checkpoint")
    if not isinstance(cfg.get("dllm"), dict):
        raise ExportError(f"{srcp / 'config.json'}: no `dllm` section (not an a2d checkpoint)")
    outp = Path(out)
    if outp.exists() and not outp.is_dir():
        raise ExportError(f"{outp}: is a file, not a directory")
    if outp.exists() and any(outp.iterdir()) and not overwrite:
        raise ExportError(f"{outp}: exists and is not empty; choose a new directory")
    return srcp, cfg, outp


def _exported_dllm(srcp: Path, cfg: dict, default_threshold, default_speculative, clear_default_threshold: bool):
    """The source's ``dllm`` section with the export's default-sampling changes (:func:`export`'s arguments)."""
    from unmask.engine.config import CheckpointError, DllmConfig, warn_removed_fields

    dllm = DllmConfig.from_dict(cfg["dllm"], where=f"{srcp / 'config.json'}:dllm")
    warn_removed_fields(cfg["dllm"], f"{srcp / 'config.json'}:dllm")  # not exported (an old checkpoint's draft head)
    if clear_default_threshold:
        if default_threshold is not None:
            raise ExportError("--no-default-threshold: cannot be combined with --default-threshold")
        dllm.default_sampling = {k: v for k, v in dllm.default_sampling.items() if k != "threshold"}
    if default_threshold is not None:
        if isinstance(default_threshold, bool) or not (isinstance(default_threshold, (int, float))
                                                       and 0 <= default_threshold <= 1):
            raise ExportError(f"--default-threshold: must be a number in [0, 1], got {default_threshold!r}")
        dllm.default_sampling = {**dllm.default_sampling, "threshold": float(default_threshold)}
    if default_speculative is not None:
        dllm.default_sampling = {**dllm.default_sampling, "speculative": bool(default_speculative)}
        try:
            dllm.validate(where="--default-speculative")
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None
    return dllm


def _verifier(srcp: Path, dllm, keep_verifier: bool):
    """``(verifier source, its dllm)`` to export beside the model (``dllm.verifier`` then names ``VERIFIER_DIR``),
    or ``(None, None)`` (a dropped verifier is no longer named)."""
    from unmask.engine.config import CheckpointError, DllmConfig
    from unmask.engine.model import read_config

    if not (dllm.verifier and keep_verifier):
        if dllm.verifier:
            dllm.verifier = None
        return None, None
    vsrc = Path(dllm.verifier).expanduser()
    vsrc = vsrc if vsrc.is_absolute() else srcp / vsrc
    try:
        vcfg = read_config(vsrc)
        vdllm = DllmConfig.from_dict(vcfg.get("dllm"), where=f"{vsrc / 'config.json'}:dllm")
    except CheckpointError as exc:
        raise ExportError(f"{srcp / 'config.json'}:dllm.verifier: {exc}") from exc
    if isinstance(vcfg.get("quantization_config"), dict):
        raise ExportError(f"{srcp / 'config.json'}:dllm.verifier: {vsrc} is quantized; export from a "
                          "full-precision verifier")
    dllm.verifier = VERIFIER_DIR
    return vsrc, vdllm


def _check_reload(model, written: Path, named: Path, dev, dt, tok) -> float:
    """:func:`verify_export` of ``written``; above 1e-4 an :class:`ExportError` naming ``named``."""
    diff = verify_export(model, written, dev, dt, tok)
    if diff > 1e-4:
        raise ExportError(f"{named}: reloaded logits differ from the exporter's by {diff:.3g} (> 1e-4); nothing was "
                          "written")
    return diff
