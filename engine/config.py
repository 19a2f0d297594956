"""The diffusion-specific description of a checkpoint: the ``dllm`` section of ``config.json``.

Every family adapter (``unmask.engine.families``) produces a :class:`DllmConfig`; the denoiser, the server and
the trainer read only this object, never family-specific fields. See docs/design.md#model-families, #checkpoints and
#decisions. Also the checkpoint-file helpers: :func:`read_json_file` (shared by every checkpoint reader),
:func:`dataclass_from_dict` and :func:`check_int` (this module's ``dllm`` parsing); errors are
:class:`CheckpointError` naming the file and field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .limits import MAX_SPECULATIVE_BLOCK, REMASKING_STRATEGIES

ATTENTION_MODES = ("bidirectional", "prefix_causal", "block_causal")
FAMILIES = ("a2d", "llada", "dream", "fast_dllm_v2", "sdar", "llada2", "llada_moe", "diffusion_gemma")
#: families with their own forward (an encoder and a decoder: ``unmask.engine.uniform_canvas``), served as loaded:
#: no weight packing, mask-row adapter or lane attention
OWN_FORWARD_FAMILIES = ("diffusion_gemma",)
BLOCK_ALIGNMENTS = ("generation", "absolute")
# request fields a checkpoint may set defaults for, with their allowed ranges (those of SamplingParams)
DEFAULT_SAMPLING_FIELDS = {"temperature": (0.0, 100.0), "threshold": (0.0, 1.0), "speculative": bool,
                           "remasking": REMASKING_STRATEGIES,
                           # the uniform-canvas sampler's (DiffusionGemma's generation_config.json)
                           "max_denoising_steps": (1, 1024), "t_min": (0.0, 100.0), "t_max": (0.0, 100.0),
                           "entropy_bound": (0.0, 1e6), "stability_threshold": (0, 1024),
                           "confidence_threshold": (0.0, 1e6)}
#: ``dllm`` keys of removed capabilities, with why: an old checkpoint that names one still loads, the key is ignored
#: (:meth:`DllmConfig.from_dict`) and its loaders log :func:`warn_removed_fields` once
REMOVED_FIELDS = {"draft_head": "the draft head was removed on 2026-12-05 and is no longer used; speculative "
                                "requests draft from the model's mask rows (a mask-row adapter replaces the head, "
                                "docs/adapter.md)"}

log = logging.getLogger("unmask.engine")


class CheckpointError(ValueError):
    """A checkpoint directory or its ``config.json`` is missing something or holds an invalid value.

    The message always names the file (and the field) at fault.
    """


def read_json_file(path: str | Path) -> dict | None:
    """A JSON object from ``path``, or None when the file does not exist.

    Raises:
        CheckpointError: the file exists but is not UTF-8, not valid JSON (names file, line and column) or not an
            object.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); JSON files are UTF-8") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def dataclass_from_dict(cls, data: Any, where: str, required: tuple[str, ...] = ()):
    """``cls(**data)`` for a dataclass ``cls`` read from a JSON object.

    Raises:
        CheckpointError: (message starts with ``where``) ``data`` is not an object, holds unknown keys (named),
            lacks one of ``required`` (named), or the constructor rejects it.
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise CheckpointError(f"{where}: unknown field(s) {unknown}")
    missing = [k for k in required if k not in data]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {missing}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


def check_int(where: str, name: str, value: Any, lo: int) -> None:
    """Raise :class:`CheckpointError` ``{where}.{name}: must be a positive (lo=1) / non-negative (lo=0) integer``
    unless ``value`` is an int (not a bool) >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        kind = "positive" if lo == 1 else "non-negative"
        raise CheckpointError(f"{where}.{name}: must be a {kind} integer, got {value!r}")


class FrozenDict(dict):
    """A ``dict`` that refuses changes (a frozen :class:`DllmConfig`'s ``default_sampling``); reads, equality, JSON
    and copies behave as a plain dict's."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a loaded model's dllm.default_sampling is read-only: the decoding plan decides the "
                        "defaults from it (unmask.engine.plan)")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = setdefault = clear = _refuse

    def __reduce__(self):
        return FrozenDict, (dict(self),)


@dataclass
class DllmConfig:
    """Diffusion settings of one checkpoint.

    Attributes:
        family: one of ``FAMILIES``.
        mask_token_id: id of the ``[MASK]`` noise token (from the checkpoint, never hard-coded in the engine).
        attention: ``bidirectional`` | ``prefix_causal`` | ``block_causal`` (docs/design.md#words).
        block_size: block size the checkpoint was trained with; the default for requests (and the draft block of
            speculative ones).
        diffusion_block_size: the default block size of requests decoded by plain diffusion (not speculatively)
            that send no ``block_size``; None = ``block_size``. A mask-row adapter drafts best at one block size and
            decodes in parallel best at another (docs/adapter.md, "Plain diffusion by block size").
        logit_shift: True when the logits for position j are read from output j-1 (AR-initialised models).
        eos_token_ids: ids that end generation (EOS and end-of-turn), in order of preference.
        pad_token_id: id used for padding rows in a batch (never generated); may equal an EOS id.
        block_alignment: ``generation`` = blocks start at the first generated position (bidirectional and
            prefix-causal models); ``absolute`` = blocks aligned to position 0 as the family was trained
            (SDAR, Fast-dLLM v2): the prompt's last partial block is completed first (docs/design.md#decisions).
        fixed_block_size: True when requests may not choose another block size (block-causal families).
        sub_block_size: Fast-dLLM v2's per-request decoding window inside a block (None elsewhere).
        default_sampling: default request fields, :data:`DEFAULT_SAMPLING_FIELDS` only (e.g.
            ``{"temperature": 0.0, "threshold": 0.7}``): what a request that leaves them unset gets (as vLLM
            applies a checkpoint's ``generation_config.json``); ``threshold`` applies only to requests that give
            neither ``steps`` nor ``threshold``; ``speculative`` (bool, prefix-causal models only) to requests that
            do not set ``speculative`` and can be decoded self-speculatively (see ``unmask.engine.plan.resolve_params``).
        suppress_token_ids: extra ids that are never generated (besides mask and pad).
        verifier: directory (relative to the checkpoint, or absolute) of a checkpoint with the same architecture
            and tokenizer whose weights run the causal rows of speculative requests (``unmask.engine.routed``):
            their output is then the verifier's greedy decoding. Needs ``prefix_causal`` with the logit shift.
    """

    family: str
    mask_token_id: int
    attention: str
    block_size: int
    logit_shift: bool
    eos_token_ids: list[int]
    pad_token_id: int | None = None
    block_alignment: str = "generation"
    fixed_block_size: bool = False
    sub_block_size: int | None = None
    default_sampling: dict[str, Any] = field(default_factory=dict)
    suppress_token_ids: list[int] = field(default_factory=list)
    verifier: str | None = None
    diffusion_block_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"dllm.{name}: a loaded model's settings are frozen after load; the decoding plan decides every "
                f"default from them and the engine's options (unmask.engine.plan.engine_defaults; "
                f"docs/design.md#decoding); dataclasses.replace makes a changed copy")
        super().__setattr__(name, value)

    def freeze(self) -> "DllmConfig":
        """Make this config read-only (``load_model`` freezes the loaded model's): assigning a field raises
        ``dataclasses.FrozenInstanceError``, changing ``default_sampling`` a ``TypeError``. Returns self."""
        object.__setattr__(self, "default_sampling", FrozenDict(self.default_sampling))
        object.__setattr__(self, "_frozen", True)
        return self

    def validate(self, where: str = "config.json:dllm") -> None:
        """Raise :class:`CheckpointError` naming the field when a value is out of range."""
        for key, allowed in (("family", FAMILIES), ("attention", ATTENTION_MODES),
                             ("block_alignment", BLOCK_ALIGNMENTS)):
            if getattr(self, key) not in allowed:
                raise CheckpointError(f"{where}.{key}: {getattr(self, key)!r} is not one of {allowed}")
        check_int(where, "block_size", self.block_size, 1)
        if self.diffusion_block_size is not None:
            check_int(where, "diffusion_block_size", self.diffusion_block_size, 1)
            if self.fixed_block_size and self.diffusion_block_size != self.block_size:
                raise CheckpointError(f"{where}.diffusion_block_size: this {self.family} model decodes with its "
                                      f"trained block size {self.block_size} only, got {self.diffusion_block_size}")
        check_int(where, "mask_token_id", self.mask_token_id, 0)
        if not self.eos_token_ids:
            raise CheckpointError(f"{where}.eos_token_ids: at least one EOS id is required")
        if self.verifier is not None:  # the directory of a checkpoint's optional verifier
            if not isinstance(self.verifier, str) or not self.verifier.strip():
                raise CheckpointError(f"{where}.verifier: must be a non-empty directory path, got {self.verifier!r}")
            if not (self.attention == "prefix_causal" and self.logit_shift):
                raise CheckpointError(f"{where}.verifier: needs prefix_causal attention with the logit shift "
                                      f"(this checkpoint: {self.attention}, logit_shift={self.logit_shift})")
        if not isinstance(self.default_sampling, dict):
            raise CheckpointError(f"{where}.default_sampling: must be an object, got "
                                  f"{type(self.default_sampling).__name__}")
        for key, value in self.default_sampling.items():
            if key not in DEFAULT_SAMPLING_FIELDS:
                raise CheckpointError(f"{where}.default_sampling.{key}: unknown field (allowed: "
                                      f"{', '.join(DEFAULT_SAMPLING_FIELDS)})")
            if DEFAULT_SAMPLING_FIELDS[key] is bool:
                if not isinstance(value, bool):
                    raise CheckpointError(f"{where}.default_sampling.{key}: must be true or false, got {value!r}")
                if key == "speculative" and value and not (self.attention == "prefix_causal" and self.logit_shift
                                                           and self.block_size <= MAX_SPECULATIVE_BLOCK):
                    raise CheckpointError(f"{where}.default_sampling.speculative: self-speculative decoding needs "
                                          f"prefix_causal attention with the logit shift and a block size <= "
                                          f"{MAX_SPECULATIVE_BLOCK} (this checkpoint: {self.attention}, logit_shift="
                                          f"{self.logit_shift}, block_size {self.block_size})")
                continue
            if DEFAULT_SAMPLING_FIELDS[key] is REMASKING_STRATEGIES:
                if value not in REMASKING_STRATEGIES:
                    raise CheckpointError(f"{where}.default_sampling.{key}: must be one of "
                                          f"{list(REMASKING_STRATEGIES)}, got {value!r}")
                continue
            lo, hi = DEFAULT_SAMPLING_FIELDS[key]
            # range first: a huge JSON integer would overflow float() inside isfinite
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
                  and math.isfinite(value))
            if not ok:
                raise CheckpointError(f"{where}.default_sampling.{key}: must be a number in [{lo}, {hi}], "
                                      f"got {value!r}")

    @property
    def never_generate_ids(self) -> list[int]:
        """Ids that get logit -inf before sampling: mask, pad (unless it is an EOS), and suppressed ids."""
        ids = {self.mask_token_id, *self.suppress_token_ids}
        if self.pad_token_id is not None and self.pad_token_id not in self.eos_token_ids:
            ids.add(self.pad_token_id)
        return sorted(ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict for the ``dllm`` section of ``config.json`` (plain dicts and lists)."""
        out = dataclasses.asdict(self)
        out["default_sampling"] = dict(out["default_sampling"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json:dllm") -> "DllmConfig":
        """Build from the ``dllm`` section; unknown keys are an error naming them, the keys of removed capabilities
        (:data:`REMOVED_FIELDS`) are ignored.

        Raises:
            CheckpointError: a required key is missing, a key is unknown, or a value is invalid.
        """
        default_where = "config.json:dllm"  # what __post_init__'s validate() names; the caller's file replaces it
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in REMOVED_FIELDS}
        try:
            return dataclass_from_dict(cls, data, where, required=(
                "family", "mask_token_id", "attention", "block_size", "logit_shift", "eos_token_ids"))
        except CheckpointError as exc:
            if where != default_where and str(exc).startswith(default_where + "."):
                raise CheckpointError(where + str(exc)[len(default_where):]) from None
            raise


def warn_removed_fields(data: Any, where: str) -> None:
    """Log a warning for each removed capability (:data:`REMOVED_FIELDS`) that the ``dllm`` section ``data`` still
    names (a value other than null); ``where`` names the section (``.../config.json:dllm``)."""
    if isinstance(data, dict):
        for key, why in REMOVED_FIELDS.items():
            if data.get(key) is not None:
                log.warning("%s.%s (%r) is ignored: %s", where, key, data[key], why)
