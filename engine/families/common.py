"""Helpers shared by the family adapters: tokenizer loading, placing weights, context length."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import DEFAULT_SAMPLING_FIELDS, CheckpointError, read_json_file  # noqa: F401 (re-exported)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (AutoTokenizer, no remote code). Raises CheckpointError when absent."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc})") from exc


def max_context_of(config: dict, default: int = 4096) -> int:
    """The model's context length from the usual config keys."""
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return default


def from_pretrained(cls, path: Path, config: dict, device: torch.device, dtype: torch.dtype, **kwargs):
    """``cls.from_pretrained`` with sdpa attention, placing quantized (bitsandbytes) weights with a device map.

    Unquantized safetensors checkpoints are read tensor by tensor with positioned reads (:func:`pread_tensors`)
    instead of transformers' whole-file memory map: the map's pages stay resident (file-backed RSS) for as long as
    any tensor views it, so on a CPU the float32 file (540 MB for SmolLM2-135M) stayed in RSS beside the packed fp16
    weights made from it and its embedding kept it mapped for the server's life (docs/design.md#mask-row-adapter,
    "Memory at start-up"). Same tensors, same values."""
    from ..checkpoint_check import check_loading_info

    quantized = isinstance(config.get("quantization_config"), dict)
    try:
        if quantized:
            model, info = cls.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype,
                                              device_map={"": str(device)}, output_loading_info=True, **kwargs)
            set_4bit_compute_dtype(model, dtype)
        else:
            state = pread_tensors(path)
            if state is None:
                model, info = cls.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype,
                                                  output_loading_info=True, **kwargs)
            else:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(str(path))
                mapping = getattr(cls, "_model_mapping", None)  # an Auto class: its concrete class for this config
                concrete = mapping[type(hf_config)] if mapping is not None else cls
                model, info = concrete.from_pretrained(None, config=hf_config, state_dict=state,
                                                       attn_implementation="sdpa", dtype=dtype,
                                                       output_loading_info=True, **kwargs)
                del state
                if (Path(path) / "generation_config.json").is_file():  # as from_pretrained(path) reads it
                    from transformers import GenerationConfig

                    model.generation_config = GenerationConfig.from_pretrained(str(path))
            model.to(device)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot load the weights ({exc})") from exc
    check_loading_info(path, type(model).__name__, info)  # missing/unexpected tensors: an error, not a note
    return model


def set_4bit_compute_dtype(model, dtype: torch.dtype) -> int:
    """Run the bitsandbytes 4-bit layers (nf4/fp4) of ``model`` in ``dtype``, the dtype it is served in; returns
    how many. A checkpoint records the compute dtype of the machine that exported it (``training/export.py``:
    float32 on a CPU, bfloat16 on a GPU), which says nothing about where it is served: an export made on a CPU
    computed in float32 on a bf16 GPU (docs/design.md#exactness-contracts-by-device-and-dtype)."""
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    for m in layers:
        m.compute_dtype, m.compute_type_is_set = dtype, True  # set: bitsandbytes keeps it at the first forward
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if layers and qc is not None:
        if isinstance(qc, dict):
            qc["bnb_4bit_compute_dtype"] = str(dtype).replace("torch.", "")
        elif hasattr(qc, "bnb_4bit_compute_dtype"):
            qc.bnb_4bit_compute_dtype = dtype
    return len(layers)


def pread_tensors(path: Path) -> dict | None:
    """``{name: lazy slice}`` over a checkpoint's safetensors file(s) (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``) opened with safetensors' ``pread`` backend: each tensor is read into its own
    memory when transformers materialises it, and no file stays memory-mapped. None when the checkpoint has no
    safetensors files or this safetensors has no ``pread`` backend (then transformers' own loading applies).
    Raises nothing of its own: a bad file is reported by the loader that reads it."""
    from safetensors import safe_open

    path = Path(path)
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        index = read_json_file(path / "model.safetensors.index.json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return None
        files = [path / str(f) for f in sorted(set(weight_map.values()))]
    state = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu", backend="pread")
        except TypeError:  # safetensors before the pread backend
            return None
        state.update({name: handle.get_slice(name) for name in handle.keys()})
    return state


# ---------------------------------------------------------------------------------------------------------------
# Helpers for foreign families (LLaDA, Dream, Fast-dLLM v2, SDAR): their checkpoints declare remote code
# (``auto_map``) that we never run; we read their weights ourselves and place them on a transformers architecture.
# ---------------------------------------------------------------------------------------------------------------

#: ``config.json`` keys that describe the original (remote-code) model rather than the transformers architecture
#: we map it onto; dropped before building the transformers config so that a re-saved model is a plain one.
FOREIGN_META_KEYS = ("architectures", "auto_map", "model_type", "attn_implementation", "_attn_implementation",
                     "torch_dtype", "dtype", "transformers_version", "_name_or_path", "quantization_config")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, on CPU, with their stored names and dtypes.

    Looks for, in order: ``model.safetensors``, ``model.safetensors.index.json`` (sharded; the shards named in
    its ``weight_map``), ``pytorch_model.bin``, ``pytorch_model.bin.index.json`` (loaded with
    ``weights_only=True``: no pickled code runs).

    Raises:
        CheckpointError: no weight file, a shard named in an index is missing, or a file cannot be read.
    """
    from safetensors.torch import load_file

    path = Path(path)

    def _load(file: Path) -> dict[str, torch.Tensor]:
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (named in the checkpoint's weight index)")
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file), device="cpu")
            return torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read the weights ({exc})") from exc

    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return _load(path / single)
        idx = read_json_file(path / index)
        if idx is not None:
            weight_map = idx.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{path / index}: `weight_map` must be a non-empty object")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                state.update(_load(path / shard))
            missing = sorted(set(weight_map) - set(state))
            if missing:
                raise CheckpointError(f"{path / index}: tensors listed in weight_map are absent from the shards: "
                                      f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
            return state
    raise CheckpointError(f"{path}: no weights found (expected model.safetensors, model.safetensors.index.json, "
                          "pytorch_model.bin or pytorch_model.bin.index.json)")


def load_mapped_model(cls, hf_config, state_dict: dict[str, torch.Tensor], path: Path, device: torch.device,
                      dtype: torch.dtype):
    """Instantiate transformers ``cls`` from ``hf_config`` and load ``state_dict`` (already renamed to ``cls``'s
    parameter names) strictly, with sdpa attention, in ``dtype`` on ``device``.

    Uses ``cls.from_pretrained(None, config=..., state_dict=...)`` so that transformers does the meta-device
    initialisation, dtype casting and weight tying.

    Raises:
        CheckpointError: a parameter is missing, a tensor is unexpected or has the wrong shape (names the first few).
    """
    from ..checkpoint_check import check_loading_info

    hf_config._attn_implementation = "sdpa"
    try:
        model, info = cls.from_pretrained(None, config=hf_config, state_dict=state_dict, attn_implementation="sdpa",
                                          dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot load the weights onto {cls.__name__} ({exc})") from exc
    check_loading_info(path, cls.__name__, info)
    model.to(device)
    return model.eval()


def load_tokenizer_without_remote_code(path: Path, fallback_classes: tuple[str, ...] = ()):
    """The checkpoint's tokenizer without running its remote code.

    Tries the class named by ``tokenizer_config.json`` when transformers has it, then ``AutoTokenizer`` (with
    ``trust_remote_code=False``); when the checkpoint names a tokenizer class that only exists as remote code
    (Dream's ``DreamTokenizer``), loads ``tokenizer.json`` with ``PreTrainedTokenizerFast`` or, failing that, the
    first transformers class in ``fallback_classes`` (e.g. ``Qwen2Tokenizer``, which reads vocab.json/merges.txt).
    The special tokens and chat template of ``tokenizer_config.json`` are kept.

    Raises:
        CheckpointError: no way of loading a tokenizer from ``path``.
    """
    import transformers
    from transformers import AutoTokenizer

    import warnings

    errors = []
    # the class named in tokenizer_config.json, when transformers has it: no detour through the foreign config.json
    named = (read_json_file(Path(path) / "tokenizer_config.json") or {}).get("tokenizer_class")
    klass = getattr(transformers, named, None) if isinstance(named, str) and named.isidentifier() else None
    if klass is not None and hasattr(klass, "from_pretrained"):
        try:
            return klass.from_pretrained(str(path))
        except Exception as exc:
            errors.append(f"{named}: {exc}")
    try:
        # trust_remote_code=False: refuse remote code at once (None would prompt on a terminal and wait).
        # AutoTokenizer may parse the foreign config.json; its legacy `rope_scaling: null` only warns there.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rope_scaling.*", category=FutureWarning)
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # remote-code class, missing files, ...
        errors.append(f"AutoTokenizer: {exc}")
    for name in ("PreTrainedTokenizerFast", *fallback_classes):
        klass = getattr(transformers, name, None)
        if klass is None or (name == "PreTrainedTokenizerFast" and not (Path(path) / "tokenizer.json").is_file()):
            continue
        try:
            return klass.from_pretrained(str(path))
        except Exception as exc:
            errors.append(f"{name}: {exc}")
    raise CheckpointError(f"{path}: cannot load the tokenizer ({'; '.join(errors)})")


def token_id_of(tokenizer, token: str) -> int | None:
    """Id of ``token`` when the tokenizer has it as one vocabulary entry, else None."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # pragma: no cover - every tokenizer we load has a vocabulary
        return None
    tid = vocab.get(token)
    return int(tid) if tid is not None else None


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def resolve_mask_token_id(path: Path, config: dict, tokenizer, mask_tokens: tuple[str, ...], default: int,
                          vocab_rows: int) -> int:
    """The family's ``[MASK]`` id, from the checkpoint (docs/design.md#model-families: never hard-coded when present).

    Order: ``config.json`` ``mask_token_id``; ``generation_config.json`` ``mask_token_id``; the family's mask
    token string in the tokenizer (``mask_tokens``); ``tokenizer.mask_token_id``; finally the published ``default``.

    Raises:
        CheckpointError: the id found is outside the model's ``vocab_rows`` embedding rows, or nothing was found
            and the default does not fit either (names where the id was expected).
    """
    gen = read_json_file(Path(path) / "generation_config.json") or {}
    candidates = [(f"{Path(path) / 'config.json'}:mask_token_id", config.get("mask_token_id")),
                  (f"{Path(path) / 'generation_config.json'}:mask_token_id", gen.get("mask_token_id"))]
    for tok in mask_tokens:
        candidates.append((f"tokenizer token {tok!r}", token_id_of(tokenizer, tok)))
    candidates.append(("tokenizer.mask_token_id", getattr(tokenizer, "mask_token_id", None)))
    for where, value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < vocab_rows:
                raise CheckpointError(f"{where}: mask token id {value} is outside the model's {vocab_rows} "
                                      "embedding rows")
            return int(value)
    if 0 <= default < vocab_rows:
        return default
    raise CheckpointError(f"{Path(path) / 'config.json'}: no mask token found (expected `mask_token_id` in config.json "
                          f"or generation_config.json, or one of {list(mask_tokens)} in the tokenizer; the published "
                          f"id {default} does not fit the model's {vocab_rows} embedding rows)")


def resolve_eos_token_ids(path: Path | None, config: dict, tokenizer, end_tokens: tuple[str, ...], default: list[int],
                          vocab_rows: int | None, *, generation_config: dict | None = None,
                          tokenizer_first: bool = False) -> list[int]:
    """EOS and end-of-turn ids, in order of preference, from the checkpoint (the one EOS rule: the engine's families
    and training, ``unmask.training.convert.eos_ids_of``, both call it).

    Collects ``config.json`` ``eos_token_id`` (int or list), ``generation_config.json`` ``eos_token_id``,
    ``tokenizer.eos_token_id`` (in the reverse order with ``tokenizer_first``: the conversion prefers the
    tokenizer's EOS) and the family's end tokens (``end_tokens``, e.g. ``<|eot_id|>``, ``<|im_end|>``) that the
    tokenizer has; drops duplicates and ids outside the embedding rows (``vocab_rows``; None: no upper bound). Falls
    back to the published ``default`` ids that fit. ``generation_config`` (a dict) replaces reading
    ``path/generation_config.json`` (a model already loaded by transformers carries it; ``path`` may then be None).

    Raises:
        CheckpointError: no EOS id at all.
    """
    if generation_config is None:
        generation_config = (read_json_file(Path(path) / "generation_config.json") if path is not None else None) or {}
    sources = [config.get("eos_token_id"), generation_config.get("eos_token_id"),
               getattr(tokenizer, "eos_token_id", None)]
    if tokenizer_first:
        sources.reverse()
    found = [t for src in sources for t in _ids(src)]
    found += [t for t in (token_id_of(tokenizer, s) for s in end_tokens) if t is not None]
    out: list[int] = []
    for t in found:
        if 0 <= t and (vocab_rows is None or t < vocab_rows) and t not in out:
            out.append(t)
    if not out:
        out = [t for t in default if 0 <= t and (vocab_rows is None or t < vocab_rows)]
    if not out:
        where = Path(path) / "config.json" if path is not None else "tokenizer"
        raise CheckpointError(f"{where}: no EOS token id (expected `eos_token_id` in config.json "
                              f"or generation_config.json, or one of {list(end_tokens)} in the tokenizer)")
    return out


def resolve_pad_token_id(config: dict, tokenizer, eos_ids: list[int], vocab_rows: int) -> int:
    """``config.json`` ``pad_token_id``, else the tokenizer's, else the first EOS id."""
    for value in (config.get("pad_token_id"), getattr(tokenizer, "pad_token_id", None)):
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_rows:
            return int(value)
    return eos_ids[0]


def unused_rows(tokenizer, vocab_rows: int, path: Path | None = None) -> list[int]:
    """Embedding rows never generated: those past the tokenizer (padding rows of a vocabulary rounded up) and the
    ``suppress_tokens`` of ``path``'s ``generation_config.json`` (transformers' key; a converted GGUF's ``[PADi]``
    entries, docs/design.md#model-families) inside the rows."""
    n = len(tokenizer)
    rows = set(range(n, vocab_rows)) if n < vocab_rows else set()
    gen = (read_json_file(Path(path) / "generation_config.json") if path is not None else None) or {}
    rows |= {t for t in _ids(gen.get("suppress_tokens")) if 0 <= t < vocab_rows}
    return sorted(rows)


def default_temperature(path: Path, family_default: float) -> float:
    """``generation_config.json`` ``temperature`` when it samples (``do_sample`` true), else the family's default
    (the default of its published generation function)."""
    gen = read_json_file(Path(path) / "generation_config.json") or {}
    t = gen.get("temperature")
    lo, hi = DEFAULT_SAMPLING_FIELDS["temperature"]
    if (gen.get("do_sample") and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and lo <= t <= hi):  # an out-of-range value is ignored, not a load failure
        return float(t)
    return float(family_default)


def declares(config: dict, architectures: tuple[str, ...], model_types: tuple[str, ...]) -> bool:
    """Whether ``config.json`` names a family: its ``architectures`` list one of ``architectures`` or its
    ``model_type``, lower-cased, is one of ``model_types``."""
    archs = config.get("architectures") or []
    return any(a in archs for a in architectures) or str(config.get("model_type", "")).lower() in model_types


def positive_int(config: dict, key: str, default: int, path: Path) -> int:
    """``config[key]`` as a positive integer (``default`` when absent). Raises CheckpointError naming the key."""
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{Path(path) / 'config.json'}:{key}: must be a positive integer, got {value!r}")
    return int(value)


def qwen_style_config(config_cls, config: dict):
    """A transformers config of ``config_cls`` (``Qwen2Config``, ``Qwen3Config``, ...) from a foreign
    ``config.json`` that already uses that architecture's key names (Dream, Fast-dLLM v2, SDAR): the remote-code
    metadata (``FOREIGN_META_KEYS``) is dropped, every other key is kept (unknown ones become plain attributes)."""
    kwargs = {k: v for k, v in config.items() if k not in FOREIGN_META_KEYS}
    if kwargs.get("rope_scaling", 0) is None:  # transformers 5 reads rope_theta alone; None only warns
        kwargs.pop("rope_scaling")
    return config_cls(**kwargs)


def build_foreign_model(path: Path, config: dict, device: torch.device, dtype: torch.dtype, *, family: str,
                        arch: str, hf_config, state_dict: dict[str, torch.Tensor], mask_tokens: tuple[str, ...],
                        default_mask: int, end_tokens: tuple[str, ...], default_eos: list[int], attention: str,
                        block_size: int, logit_shift: bool, block_alignment: str = "generation",
                        fixed_block_size: bool = False, sub_block_size: int | None = None,
                        family_temperature: float = 0.0, tokenizer_fallbacks: tuple[str, ...] = (),
                        tokenizer=None, build=None):
    """Shared tail of the foreign family adapters: load ``state_dict`` (already in ``arch``'s key names) onto the
    transformers class ``arch`` built from ``hf_config`` (or by ``build(hf_config, state_dict, device, dtype)``, a
    family whose modules transformers lacks), load the tokenizer (unless given), resolve mask/EOS/pad ids and return
    a :class:`~unmask.engine.model.LoadedModel` with the family's :class:`DllmConfig`.

    Raises:
        CheckpointError: weights, tokenizer or ids do not fit (see the helpers above).
    """
    import transformers

    from ..config import DllmConfig
    from ..loaded import LoadedModel

    cls = getattr(transformers, arch)
    if tokenizer is None:
        tokenizer = load_tokenizer_without_remote_code(path, tokenizer_fallbacks)
    vocab_rows = int(hf_config.vocab_size)
    mask_id = resolve_mask_token_id(path, config, tokenizer, mask_tokens, default_mask, vocab_rows)
    eos = resolve_eos_token_ids(path, config, tokenizer, end_tokens, default_eos, vocab_rows)
    eos = [t for t in eos if t != mask_id] or eos
    pad = resolve_pad_token_id(config, tokenizer, eos, vocab_rows)
    dllm = DllmConfig(family=family, mask_token_id=mask_id, attention=attention, block_size=block_size,
                      logit_shift=logit_shift, eos_token_ids=eos, pad_token_id=pad, block_alignment=block_alignment,
                      fixed_block_size=fixed_block_size, sub_block_size=sub_block_size,
                      default_sampling={"temperature": default_temperature(path, family_temperature)},
                      suppress_token_ids=unused_rows(tokenizer, vocab_rows, path))
    if build is None:
        model = load_mapped_model(cls, hf_config, state_dict, path, device, dtype)
    else:
        model = build(hf_config, state_dict, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, dllm=dllm, path=str(path), device=device, dtype=dtype,
                       max_context=max_context_of(config))
