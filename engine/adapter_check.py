"""Refusing broken mask-row adapter files at load, one line naming the file and the problem
(docs/design.md#checks-at-load and #mask-row-adapter).

:func:`check_adapter_config` checks ``mask_adapter.json``'s fields; :func:`check_adapter_tensors` checks
``mask_adapter.safetensors`` from its header (:func:`unmask.engine.checkpoint_check.safetensors_header`: whole
file, no tensor read) against the names and shapes the adapter must have, and then its values
(:func:`unmask.engine.checkpoint_check.count_nonfinite`). Both run before any module of the model is wrapped.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .checkpoint_check import FLOAT_DTYPES, check_magnitude, count_nonfinite, safetensors_header
from .config import CheckpointError
from .limits import ADAPTER_VERSIONS, MAX_ADAPTER_RANK, MAX_ADAPTER_SCALE, MAX_WEIGHT_MAGNITUDE

#: the largest ``alpha / rank`` accepted (:data:`unmask.engine.limits.MAX_ADAPTER_SCALE`)
MAX_SCALE = MAX_ADAPTER_SCALE


def check_adapter_config(cfg_file: Path, cfg: dict, fmt: str, known_targets: tuple[str, ...]) -> None:
    """``mask_adapter.json``: ``format`` is ``fmt`` and ``version`` one of
    :data:`~unmask.engine.limits.ADAPTER_VERSIONS` (absent: 1); ``rank`` an integer in 1..MAX_ADAPTER_RANK;
    ``alpha`` a finite number > 0 with ``alpha / rank`` <= :data:`~unmask.engine.limits.MAX_ADAPTER_SCALE`; ``targets`` a non-empty list of distinct names among ``known_targets``;
    ``mask_token_id`` an integer >= 0; ``parent`` an object whose ``sha256`` is a ``sha256:<hex>`` string.

    Raises:
        CheckpointError: naming ``cfg_file`` and the field.
    """
    if cfg.get("format") != fmt:
        raise CheckpointError(f"{cfg_file}: not a mask-adapter config (format must be {fmt!r})")

    version = cfg.get("version", 1)
    if version not in ADAPTER_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{cfg_file}: field 'version': {version!r} is not a mask-adapter format version this "
                              f"server reads ({', '.join(map(str, ADAPTER_VERSIONS))}): written by a newer unmask?")

    def bad(key: str, want: str):
        return CheckpointError(f"{cfg_file}: field {key!r}: must be {want}, got {cfg.get(key, '(missing)')!r}")

    rank, alpha = cfg.get("rank"), cfg.get("alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_ADAPTER_RANK:
        raise bad("rank", f"an integer in 1..{MAX_ADAPTER_RANK}")
    if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0
            or alpha / rank > MAX_SCALE):
        raise bad("alpha", f"a finite number > 0 with alpha / rank <= {MAX_SCALE:g} (LoRA scales are 0.5-16)")
    targets = cfg.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise bad("targets", f"a non-empty list of names among {list(known_targets)}")
    unknown = [t for t in targets if t not in known_targets]
    if unknown:
        raise CheckpointError(f"{cfg_file}: field 'targets': {unknown} are not among {list(known_targets)}")
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise CheckpointError(f"{cfg_file}: field 'targets': {dup} listed more than once")
    mid = cfg.get("mask_token_id")
    if not isinstance(mid, int) or isinstance(mid, bool) or mid < 0:
        raise bad("mask_token_id", "an integer >= 0")
    parent = cfg.get("parent")
    if not isinstance(parent, dict):
        raise bad("parent", "an object with the parent's 'sha256' content hash")
    if not isinstance(parent.get("sha256"), str) or not parent["sha256"].startswith("sha256:"):
        raise CheckpointError(f"{cfg_file}: field 'parent.sha256': must be a 'sha256:<hex>' content hash, got "
                              f"{parent.get('sha256', '(missing)')!r}")


def expected_shapes(rank: int, targets, projections: dict[tuple[int, str], tuple[int, int]] | None,
                    hidden: int | None, header: dict[str, tuple[list[int], str]]) -> dict[str, list[int | None]]:
    """``{tensor name: shape}`` an adapter must hold: ``layers.<i>.<t>.lora_A [rank, in]`` and ``.lora_B
    [out, rank]`` for every layer ``i`` and target ``t``, and ``mask_embedding [hidden]`` (optional: absent, the
    parent's row is used; it is listed only when ``header`` has it). ``projections``: ``{(i, t): (out, in)}`` of
    the model the adapter goes on; None (no model: training tools reading an adapter) takes the layer count from
    the largest index in ``header`` and leaves ``in``/``out``/``hidden`` free (None), consistent per target."""
    if projections is None:
        idx = [int(p[1]) for p in (n.split(".") for n in header) if len(p) == 4 and p[0] == "layers"
               and p[1].isdigit()]
        n_layers = 1 + max(idx, default=0)  # at least layer 0
        projections = {(i, t): (None, None) for i in range(n_layers) for t in targets}
    want: dict[str, list[int | None]] = {}
    for (i, t), (out_f, in_f) in sorted(projections.items()):
        if t in targets:
            want[f"layers.{i}.{t}.lora_A"] = [rank, in_f]
            want[f"layers.{i}.{t}.lora_B"] = [out_f, rank]
    if "mask_embedding" in header:
        want["mask_embedding"] = [hidden]
    return want


def check_adapter_tensors(wfile: Path, rank: int, targets, projections=None, hidden: int | None = None) -> None:
    """The header of ``wfile`` (``mask_adapter.safetensors``) holds exactly the tensors of
    :func:`expected_shapes` (none missing, none unexpected), each of that shape (free dimensions: the same for
    every layer of a target) and of a floating-point dtype.

    Raises:
        CheckpointError: naming ``wfile`` and the first tensor at fault (or the file: truncated, not safetensors).
    """
    header = safetensors_header(wfile)
    want = expected_shapes(rank, targets, projections, hidden, header)
    n_layers = len({n.split(".")[1] for n in want if n != "mask_embedding"})
    missing = [n for n in want if n not in header]
    unexpected = sorted(n for n in header if n not in want)
    if missing or unexpected:
        parts = [f"{len(missing)} missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"] \
            if missing else []
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])}"
                         f"{', ...' if len(unexpected) > 4 else ''})")
        raise CheckpointError(f"{wfile}: the tensors do not match a rank-{rank} adapter of targets "
                              f"{list(targets)} over {n_layers} layers: " + "; ".join(parts))
    free: dict[tuple[str, int], int] = {}  # (target.kind, dim) -> the size the first layer fixed
    for name, shape_want in want.items():
        shape, dtype = header[name]
        key = name.split(".", 2)[-1] if name != "mask_embedding" else name
        ok = len(shape) == len(shape_want)
        for d, (got, w) in enumerate(zip(shape, shape_want)) if ok else ():
            ok = ok and (got == w if w is not None else free.setdefault((key, d), got) == got and got >= 1)
        if not ok:
            shown = [w if w is not None else free.get((key, d), "n") for d, w in enumerate(shape_want)]
            raise CheckpointError(f"{wfile}: tensor {name} has shape {shape}, expected {shown}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{wfile}: tensor {name} has dtype {dtype}, expected a floating-point tensor "
                                  f"({', '.join(sorted(FLOAT_DTYPES))})")


def check_adapter_values(wfile: Path, tensors: dict[str, torch.Tensor], max_magnitude: float | None = None) -> None:
    """Every tensor of the adapter is finite and no value's magnitude exceeds ``max_magnitude`` (default
    :data:`~unmask.engine.limits.MAX_WEIGHT_MAGNITUDE`; 0 = no bound).

    Raises:
        CheckpointError: naming ``wfile``, the first tensor holding NaN/inf and how many.
    """
    for name in sorted(tensors):
        bad = count_nonfinite(tensors[name])
        if bad:
            raise CheckpointError(f"{wfile}: tensor {name} holds {bad} non-finite value(s) (NaN/inf) of "
                                  f"{tensors[name].numel()}: the adapter is corrupt (a diverged training run or a "
                                  f"damaged file)")
        check_magnitude(tensors[name], name, wfile, MAX_WEIGHT_MAGNITUDE if max_magnitude is None else max_magnitude)
