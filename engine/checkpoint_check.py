"""Refusing corrupt checkpoints at load, with one line naming the file and the problem (docs/design.md#checks-at-load).

:func:`load_checked` is what :func:`unmask.engine.model.load_model` calls instead of the family adapter's ``load``:

1. before any weight is read (:func:`check_files`): the directory is not a staging directory of a writer that is
   not this process (``engine/checkpoint.py: WRITER_MARKER``); the transformers fields of ``config.json`` have the
   right types and ranges; weight files exist (every shard an index names); every safetensors file has a valid
   header whose tensors cover the file exactly (catches truncated and garbage files from the first 8 bytes and the
   header alone); some tokenizer file exists; for ``a2d`` checkpoints that are not quantized, the tensor names and
   shapes in the headers are exactly those of the model ``config.json`` describes (built on the meta device: no
   memory), ties and transformers' ignore lists allowed for;
2. the adapter loads the model, with transformers' progress bar and load report silenced (a refusal is one line);
3. after the load (:func:`check_loaded`): every token id of the ``dllm`` section lies inside the LM head's rows,
   the block size fits the context, and every floating-point weight is finite (per tensor, in chunks of
   :data:`FINITE_CHUNK` elements: a sum first, ``torch.isfinite`` only where it is not finite; never a copy).

Every problem is a :class:`~unmask.engine.config.CheckpointError` whose message is one line; an unexpected
library exception during the load is turned into one too (naming the directory and the exception type).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import struct
from pathlib import Path

import torch

from .checkpoint import WRITER_MARKER
from .config import OWN_FORWARD_FAMILIES, CheckpointError, DllmConfig, read_json_file
from .limits import MAX_WEIGHT_MAGNITUDE
from .template_check import check_chat_template

FINITE_CHUNK = 1 << 24  # elements per torch.isfinite call: a 16 MiB bool temporary at most
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                     "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}  # safetensors' floating-point dtypes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")
# transformers config fields (any family's spelling) that must be positive integers when present
POSITIVE_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim", "d_model",
                       "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "embedding_size",
                       "max_sequence_length", "n_positions")
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines, tabs) collapsed to one space."""
    return " ".join(str(message).split())


def load_checked(adapter, path: Path, config: dict, device: torch.device, dtype: torch.dtype,
                 max_magnitude: float = MAX_WEIGHT_MAGNITUDE):
    """``adapter.load(path, config, device, dtype)`` between :func:`check_files` and :func:`check_loaded`.

    Raises:
        CheckpointError: (one line) the first problem found; library errors during the load are wrapped.
    """
    check_files(path, config, adapter.name)
    try:
        with _quiet_transformers():
            loaded = adapter.load(path, config, device, dtype)
    except CheckpointError as exc:
        raise CheckpointError(one_line(str(exc))) from exc
    except Exception as exc:  # a library's error (huggingface_hub's StrictDataclass errors, SafetensorError, ...)
        raise CheckpointError(one_line(f"{path}: cannot load ({type(exc).__name__}: {exc})")) from exc
    check_loaded(loaded, path, max_magnitude)
    return loaded


# ------------------------------------------------------------------------------------------------ before loading

def check_files(path: Path, config: dict, family: str) -> None:
    """The checks that need no weights in memory (see the module docstring, step 1).

    Raises:
        CheckpointError: naming the file (and field or tensor) at fault.
    """
    path = Path(path)
    check_not_staging(path)
    # its own errors name the field (docs/design.md#checkpoints)
    if family == "a2d" and isinstance(config.get("dllm"), dict):
        DllmConfig.from_dict(config["dllm"], where=f"{path / 'config.json'}:dllm")
    check_config_fields(path / "config.json", config)
    headers = check_weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: incomplete checkpoint: no tokenizer file (expected one of "
                              f"{', '.join(TOKENIZER_FILES)})")
    if headers is None or isinstance(config.get("quantization_config"), dict):
        return  # quantized weights are integers by design; their loader checks them (check_loading_info)
    if family == "a2d":
        check_tensor_names(path, headers)
        return
    for name, (file, _, dtype) in headers.items():  # other families: no meta model, the names say it
        if name.endswith((".weight", ".bias")) and dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, an unquantized checkpoint's weights are "
                                  f"floating-point ({', '.join(sorted(FLOAT_DTYPES))})")


def check_not_staging(path: Path) -> None:
    """Refuse a directory carrying :data:`WRITER_MARKER` unless this very process wrote it (an export verifying
    its own staging directory): it is a half-written checkpoint or export."""
    marker = path / WRITER_MARKER
    if not marker.exists():
        return
    try:
        host, pid = marker.read_text().split()
    except (OSError, ValueError):
        host, pid = "?", "?"
    if host == socket.gethostname() and pid == str(os.getpid()):
        return
    raise CheckpointError(f"{marker}: {path} is a temporary (staging) directory of a checkpoint writer or export "
                          f"(pid {pid} on {host}) that did not finish; serve the published directory instead")


def check_config_fields(cfg_file: Path, config: dict) -> None:
    """Types and ranges of the size fields transformers reads (it would fail later with a traceback or, for some,
    build a wrong model)."""
    for key in POSITIVE_INT_FIELDS:
        if key in config and config[key] is not None:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"{cfg_file}: {key}: must be a positive integer, got {value!r}")
    for key in POSITIVE_FLOAT_FIELDS:
        if key in config and config[key] is not None:
            value = config[key]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e300
            if not ok or not math.isfinite(value):
                raise CheckpointError(f"{cfg_file}: {key}: must be a positive finite number, got {value!r}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise CheckpointError(f"{cfg_file}: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv})")
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and isinstance(heads, int) and config.get("head_dim") is None and hidden % heads:
        raise CheckpointError(f"{cfg_file}: hidden_size ({hidden}) must be a multiple of num_attention_heads "
                              f"({heads})")


def check_weight_files(path: Path) -> dict[str, tuple[Path, list[int], str]] | None:
    """The weight files exist and every safetensors file is whole; returns ``{tensor: (file, shape, dtype)}`` from
    the safetensors headers (dtype as spelled there, ``F32``; None for ``pytorch_model.bin`` checkpoints, checked by
    their loader)."""
    index_file = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index_file.is_file():
        index = read_json_file(index_file)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file}: `weight_map` must be a non-empty object")
        files = [path / str(f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (incomplete checkpoint: named in {index_file.name})")
    elif (path / "pytorch_model.bin").is_file() or (path / "pytorch_model.bin.index.json").is_file():
        return None
    else:
        raise CheckpointError(f"{path}: incomplete checkpoint: no weights found (expected model.safetensors, "
                              "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json)")
    headers: dict[str, tuple[Path, list[int], str]] = {}
    for f in files:
        for name, (shape, dtype) in safetensors_header(f).items():
            headers[name] = (f, shape, dtype)
    if index_file.is_file() and not (path / "model.safetensors").is_file():
        absent = sorted(set(weight_map) - set(headers))
        if absent:
            raise CheckpointError(f"{index_file}: tensors listed in weight_map are absent from the shards: "
                                  f"{absent[:5]}{' ...' if len(absent) > 5 else ''}")
    return headers


def safetensors_header(file: Path) -> dict[str, tuple[list[int], str]]:
    """``{tensor name: (shape, dtype)}`` of a safetensors file, after checking that its header parses and that the tensors'
    byte ranges match their dtypes and shapes and cover the file exactly (the format's rule).

    Raises:
        CheckpointError: naming the file: truncated (fewer bytes than the header declares), not safetensors,
            inconsistent, or not a readable file (a directory, a dangling link).
    """
    try:
        size = file.stat().st_size
        fh = open(file, "rb")
    except OSError as exc:  # a directory or a dangling link in place of the file
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror})") from None
    with fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: not a safetensors file ({size} bytes; truncated or empty)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CheckpointError(f"{file}: not a safetensors file (header length {n} is implausible: garbage or "
                                  "another format)")
        if 8 + n > size:
            raise CheckpointError(f"{file}: truncated: {size} bytes, but its header alone needs {8 + n}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not a safetensors file (header is not JSON: {exc}; garbage or another "
                              "format)") from None
    out: dict[str, tuple[list[int], str]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], list(info["shape"]), info["data_offsets"]
            need = SAFETENSORS_BYTES[dtype] * math.prod(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r}: malformed header entry {str(info)[:80]}") from None
        if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop) or stop - begin != need:
            raise CheckpointError(f"{file}: tensor {name!r}: data offsets {[begin, stop]} do not hold a {dtype} "
                                  f"tensor of shape {shape} ({need} bytes)")
        out[name] = (shape, dtype)
        end = max(end, stop)
    data = size - 8 - n
    if data < end:
        raise CheckpointError(f"{file}: truncated: {data} bytes of tensor data, the header declares {end} "
                              f"(an interrupted copy or download)")
    if data > end:
        raise CheckpointError(f"{file}: {data - end} bytes after the last tensor (corrupt or appended to)")
    return out


def check_tensor_names(path: Path, headers: dict[str, tuple[Path, list[int], str]], model_class=None) -> None:
    """The stored tensors are exactly the ones of the model ``config.json`` describes (shapes included, and a
    floating-point dtype for every floating-point parameter or buffer: an ``I32`` weight would be cast silently).

    The model (``model_class``, default ``AutoModelForCausalLM``'s class for the config) is built on the meta device
    (no memory). A tensor tied to another (``tie_word_embeddings``) may be
    absent when one of its group is stored; names matching the class's ``_keys_to_ignore_on_load_*`` are allowed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_file = path / "config.json"
    try:
        with _quiet_transformers():
            hf_config = AutoConfig.from_pretrained(str(path))
            with torch.device("meta"):
                model = (AutoModelForCausalLM.from_config(hf_config) if model_class is None
                         else model_class(hf_config))
    except Exception as exc:  # transformers' own validation of config.json (strict dataclass fields, ...)
        raise CheckpointError(one_line(f"{cfg_file}: {type(exc).__name__}: {exc}")) from exc
    groups: dict[int, list[str]] = {}
    shapes: dict[str, list[int]] = {}
    floats: set[str] = set()
    for name, tensor in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(tensor), []).append(name)
        shapes[name] = list(tensor.shape)
        if tensor.is_floating_point():
            floats.add(name)
    persistent = {n for n, _ in model.state_dict(keep_vars=True).items()}
    for name, tensor in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            groups.setdefault(id(tensor), []).append(name)
            shapes[name] = list(tensor.shape)
            if tensor.is_floating_point():
                floats.add(name)
    ignore_missing = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or ())]
    ignore_unexpected = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    missing = [names[0] for names in groups.values()
               if not any(n in headers for n in names) and not any(p.search(names[0]) for p in ignore_missing)]
    unexpected = [n for n in headers if n not in shapes and not any(p.search(n) for p in ignore_unexpected)]
    what = f"{model.__class__.__name__} built from {cfg_file.name}"
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_few(sorted(missing))})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_few(sorted(unexpected))})")
        where = sorted({str(headers[n][0].name) for n in unexpected} or {f.name for f, _, _ in headers.values()})
        raise CheckpointError(f"{path / where[0]}: the stored tensors do not match the {what}: "
                              + "; ".join(parts) + " - was num_hidden_layers (or another size) changed?")
    for name, (file, shape, dtype) in headers.items():
        if name in shapes and shapes[name] != shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {shape}, the {what} expects {shapes[name]}")
        if name in floats and dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, the {what} expects a floating-point "
                                  f"tensor ({', '.join(sorted(FLOAT_DTYPES))})")


def check_loading_info(path: Path, cls_name: str, info: dict) -> None:
    """Missing, unexpected or mismatched tensors in transformers' ``output_loading_info`` are an error (not the
    library's note): the second line of defence for what :func:`check_tensor_names` does not cover (quantized
    checkpoints, foreign families' renamed state dicts).

    Raises:
        CheckpointError: naming ``path``, the class and the first few tensors of each kind.
    """
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        items = sorted(str(k) for k in (info.get(kind) or ()))
        if items:
            problems.append(f"{kind.replace('_', ' ')}: {items[:6]}{' ...' if len(items) > 6 else ''}")
    if problems:
        raise CheckpointError(f"{path}: the weights do not match {cls_name} built from config.json ("
                              + "; ".join(problems) + ")")


def _few(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


# ------------------------------------------------------------------------------------------------- after loading

def check_loaded(loaded, path: Path, max_magnitude: float = MAX_WEIGHT_MAGNITUDE) -> None:
    """Token ids inside the vocabulary, the mask token none of EOS/pad/BOS, block size inside the context, a chat
    template that compiles and renders (:mod:`.template_check`), finite weights no larger than ``max_magnitude``
    (module docstring, step 3).

    Raises:
        CheckpointError: naming ``config.json`` and the field, or the weight file and the tensor.
    """
    path = Path(path)
    dllm, vocab = loaded.dllm, loaded.vocab_size
    where = f"{path / 'config.json'}:dllm"
    ids = [("mask_token_id", dllm.mask_token_id), ("pad_token_id", dllm.pad_token_id)]
    ids += [(f"eos_token_ids[{i}]", t) for i, t in enumerate(dllm.eos_token_ids)]
    ids += [(f"suppress_token_ids[{i}]", t) for i, t in enumerate(dllm.suppress_token_ids)]
    sentinel = dllm.family in OWN_FORWARD_FAMILIES  # no mask token: its id is the sentinel past the vocabulary
    for name, tid in ids:
        if (tid is None and name == "pad_token_id") or (sentinel and name == "mask_token_id" and tid == vocab):
            continue
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab:
            raise CheckpointError(f"{where}.{name}: {tid!r} is not a token id of this model (the LM head has "
                                  f"{vocab} rows: 0..{vocab - 1})")
    if not sentinel:
        check_mask_distinct(dllm.mask_token_id, dllm, getattr(loaded.tokenizer, "bos_token_id", None),
                            f"{where}.mask_token_id")
    check_block_sizes(dllm, loaded.max_context, where)
    check_chat_template(loaded.tokenizer, path)
    check_finite(loaded.model, path, max_magnitude)


def check_mask_distinct(mask: int, dllm: DllmConfig, bos: int | None, where: str) -> None:
    """The mask token ``mask`` is not one of ``dllm``'s EOS ids, its pad id or the BOS id: a masked position
    would read as the end (or the padding, or a new document), and decoding would stop or emit nothing.

    Raises:
        CheckpointError: ``where`` (the file and field) and the id it collides with.
    """
    for name, ids in (("eos_token_ids", dllm.eos_token_ids), ("pad_token_id", [dllm.pad_token_id]),
                      ("the tokenizer's bos_token_id", [bos])):
        if mask in ids:
            raise CheckpointError(f"{where}: {mask} is also {name}: the mask token must be a token "
                                  "of its own (distinct from EOS, pad and BOS)")


def check_block_sizes(dllm: DllmConfig, max_context: int, where: str) -> None:
    """:class:`CheckpointError` naming ``where``'s field: a default block longer than the model's context."""
    for name in ("block_size", "diffusion_block_size"):
        if (getattr(dllm, name) or 0) > max_context:
            raise CheckpointError(f"{where}.{name}: {getattr(dllm, name)} exceeds the model's context of {max_context}")


@torch.no_grad()
def check_finite(model: torch.nn.Module, path: Path, max_magnitude: float = MAX_WEIGHT_MAGNITUDE) -> None:
    """Every floating-point parameter and buffer of ``model`` is finite (no NaN, no inf), and every parameter's
    magnitude is at most ``max_magnitude`` (:data:`unmask.engine.limits.MAX_WEIGHT_MAGNITUDE`; 0 = no bound;
    buffers such as attention-mask fill values are exempt).

    Cost: one read of the weights (a sum per chunk of :data:`FINITE_CHUNK` elements; 0.1 s for SmolLM2-135M's
    float32 weights on one core); the elementwise ``torch.isfinite`` (at most :data:`FINITE_CHUNK` bools extra) runs
    only on a chunk whose sum is not finite. Tensors are viewed, never copied; integer (quantized) weights skipped.

    Raises:
        CheckpointError: naming the weight file, the first tensor with non-finite values and how many it holds.
    """
    seen: set[int] = set()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if id(tensor) in seen or not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        seen.add(id(tensor))
        bad = count_nonfinite(tensor)
        if bad:
            raise CheckpointError(f"{_weight_file(path)}: tensor {name} holds {bad} non-finite value(s) "
                                  f"(NaN/inf) of {tensor.numel()}: the weights are corrupt (a diverged "
                                  "training run or a damaged file)")
    for name, tensor in model.named_parameters():  # each shared tensor once
        check_magnitude(tensor, name, _weight_file(path), max_magnitude)


@torch.no_grad()
def check_magnitude(tensor: torch.Tensor, name: str, file: Path, max_magnitude: float = MAX_WEIGHT_MAGNITUDE) -> None:
    """:class:`CheckpointError` naming ``file`` and ``name`` when a finite floating-point ``tensor`` holds a value
    of magnitude above ``max_magnitude`` (no trained model has one: a scaled or overwritten file); 0 = no bound.
    One min/max pass per chunk of :data:`FINITE_CHUNK` elements, no copy."""
    if not max_magnitude or not tensor.is_floating_point() or tensor.device.type == "meta" or not tensor.numel():
        return
    largest = 0.0
    for c in tensor.detach().reshape(-1).split(FINITE_CHUNK):
        lo, hi = torch.aminmax(c)
        largest = max(largest, abs(float(lo)), abs(float(hi)))
    if largest > max_magnitude:
        raise CheckpointError(f"{file}: tensor {name} holds a value of magnitude {largest:.3g}, above "
                              f"{max_magnitude:g} (no trained model's weights are that large: a corrupt or scaled "
                              "file; --max-weight-magnitude raises the bound, 0 removes it)")


@torch.no_grad()
def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many elements of ``tensor`` are NaN or inf (0 for integer tensors), in chunks of :data:`FINITE_CHUNK`
    elements: a sum per chunk first (NaN/inf propagate), the elementwise ``torch.isfinite`` only on a chunk whose
    sum is not finite (a real NaN/inf, or an overflow of huge finite values). A view, never a copy, when
    ``tensor`` is contiguous."""
    if not tensor.is_floating_point():
        return 0
    flat = tensor.detach().reshape(-1)
    if not any(not bool(torch.isfinite(c.sum())) and not bool(torch.isfinite(c).all())
               for c in flat.split(FINITE_CHUNK)):
        return 0
    return sum(int((~torch.isfinite(c)).sum()) for c in flat.split(FINITE_CHUNK))


def _weight_file(path: Path) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    return path


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars off and its log at error level for the duration (a refusal stays one line; the
    load report of missing/unexpected tensors is replaced by this module's errors)."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()
