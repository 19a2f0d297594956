"""A model larger than one device: its layers split between a device, the CPU's memory and disk (accelerate).

``load_model(..., device_map=...)`` / ``unmask serve --device-map`` call :func:`place_model` once, after the family
adapter has loaded the model: accelerate's ``infer_auto_device_map`` decides, from ``max_memory``, which top-level
modules (embedding, decoder layers, norm, LM head; a decoder layer is never split) live on the compute device, in
CPU memory or on disk, and ``dispatch_model`` moves them there and installs the hooks that bring an offloaded
layer's weights to the compute device for its forward and drop them after (docs/design.md#scale-out). The
computation is the unsplit model's, layer by layer, so the tokens are the same (``tests/engine/test_device_map.py``).

What accelerate calls the main device is the one every layer *computes* on: the first accelerator in the map, else
the CPU. ``"cpu"`` and ``"disk"`` entries are where weights are *stored*. The engine keeps one KV cache on one device,
so a map may name at most one accelerator (``cuda:0`` + ``cpu`` + ``disk`` is fine; ``cuda:0`` + ``cuda:1`` is
refused: that is pipeline parallelism, which this engine does not do).

Limits: the weights are read in full into CPU memory once before being dispatched (the family loaders read whole
checkpoints), so CPU RAM must hold the model at load time; disk offload then bounds the resident memory while
serving. Offloaded weights run as loaded (``weights="native"``): fbgemm packing would materialise them all. A verifier
(``dllm.verifier``) is refused with a device map (its weights are routed per row, not per layer).
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

#: accelerate's placement strategies (``infer_auto_device_map`` under ``max_memory``; ``balanced`` spreads over the
#: accelerators, ``sequential`` fills them in order)
STRATEGIES = ("auto", "balanced", "sequential")


def parse_device_map(spec: str | dict | None) -> str | dict | None:
    """A ``device_map`` setting: None, a strategy (:data:`STRATEGIES`), a dict ``{module name: device}`` (device
    ``"cpu"``, ``"disk"``, ``"cuda:N"`` or an int N), a JSON object string, or a path to a JSON file holding one.

    Raises:
        ValueError: (names ``device_map``) not one of those, or a device that is not cpu/disk/cuda[:N]/N.
    """
    if spec is None or isinstance(spec, dict):
        value = spec
    elif spec in STRATEGIES:
        return spec
    else:
        text = str(spec)
        if not text.lstrip().startswith("{") and Path(text).is_file():
            text = Path(text).read_text()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"device_map: {spec!r} is not one of {', '.join(STRATEGIES)}, a JSON object or a JSON "
                             f"file ({exc})") from exc
        if not isinstance(value, dict):
            raise ValueError(f"device_map: {spec!r} must be a JSON object of module name -> device")
    if value is not None:
        for name, dev in value.items():
            if not (isinstance(dev, int) and dev >= 0) and not re.fullmatch(r"cpu|disk|cuda(:\d+)?|\d+", str(dev)):
                raise ValueError(f"device_map: {name!r} -> {dev!r} is not cpu, disk, cuda[:N] or a device index")
    return value


def parse_max_memory(spec: str | dict | None) -> dict | None:
    """``max_memory`` for accelerate: a dict, or ``"cpu=200MB,0=20GiB"`` (device index or ``cpu`` = size with
    accelerate's units). Raises ``ValueError`` (names ``max_memory``) for a malformed entry."""
    if spec is None or isinstance(spec, dict):
        return spec
    out: dict[Any, str] = {}
    for part in str(spec).split(","):
        key, sep, size = part.strip().partition("=")
        if not sep or not re.fullmatch(r"cpu|\d+", key) or not re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]?i?B?", size.strip(),
                                                                             flags=re.I):
            raise ValueError(f"max_memory: {part!r} is not DEVICE=SIZE (DEVICE cpu or an accelerator index, SIZE like "
                             f"200MB or 20GiB)")
        out["cpu" if key == "cpu" else int(key)] = size.strip()
    return out


def _accelerators(device_map: dict) -> set[str]:
    devs = set()
    for dev in device_map.values():
        s = str(dev)
        if s not in ("cpu", "disk"):
            devs.add(f"cuda:{s}" if s.isdigit() else ("cuda:0" if s == "cuda" else s))
    return devs


def _memory_on(device: torch.device, max_memory: dict | None) -> dict:
    """``max_memory`` (None = accelerate's measure of every device) restricted to ``device`` (its accelerator
    index), the CPU and disk: a strategy then never places a module on another accelerator."""
    from accelerate.utils import get_max_memory

    mem = dict(get_max_memory(max_memory))
    index = (device.index or 0) if device.type == "cuda" else None
    return {k: v for k, v in mem.items() if k in ("cpu", "disk") or k == index}


def infer_device_map(model: torch.nn.Module, strategy: str = "auto", max_memory: dict | None = None) -> dict:
    """accelerate's ``infer_auto_device_map`` for ``model`` under ``max_memory`` (decoder layers kept whole, tied
    weights together); ``balanced`` first spreads ``max_memory`` over the accelerators (``get_balanced_memory``)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if strategy == "balanced":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)


def place_model(loaded, device_map: str | dict | None, max_memory: str | dict | None = None,
                offload_folder: str | Path | None = None, device: torch.device | str | None = None) -> dict | None:
    """Split ``loaded.model`` (a :class:`~unmask.engine.model.LoadedModel` on the CPU or one accelerator, weights
    native) by ``device_map`` and dispatch it with accelerate; sets ``loaded.device`` to the compute device and
    ``loaded.device_map`` to the map used. Returns that map (None: ``device_map`` None, nothing done).

    ``offload_folder``: where ``"disk"`` modules' weights go (numpy memmaps); default a temporary directory kept for
    the life of the process. ``device``: the compute device asked for (``load_model``'s ``device``): a strategy
    places modules only on it, the CPU and disk; None = wherever accelerate finds room.

    Raises:
        ValueError: (names ``device_map``) a malformed map, more than one accelerator, packed weights, a verifier, or
            a map that does not cover the model's modules (accelerate's message); (names ``max_memory``) a
            ``max_memory`` beside an explicit map, which would ignore it.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    spec = parse_device_map(device_map)
    if spec is None:
        return None
    if loaded.weight_format != "native":
        raise ValueError(f"device_map: the weights are packed ({loaded.weight_format}); load with weights='native'")
    if loaded.row_variant is not None:
        raise ValueError("device_map: not supported with a verifier (per-row weights)")
    mem = parse_max_memory(max_memory)
    if mem is not None and not isinstance(spec, str):
        raise ValueError("max_memory: an explicit device_map places every module itself; max_memory is read only "
                         "by device_map auto | balanced | sequential")
    model = loaded.model
    if isinstance(spec, str) and device is not None:
        mem = _memory_on(torch.device(device), mem)
    dmap = infer_device_map(model, spec, mem) if isinstance(spec, str) else dict(spec)
    if dmap.get("") == "disk" or not any(d != "disk" for d in dmap.values()):
        raise ValueError(f"device_map: max_memory {mem} leaves no module in memory (the whole model would go to disk)")
    accel = _accelerators(dmap)
    if len(accel) > 1:
        raise ValueError(f"device_map: names {len(accel)} accelerators ({', '.join(sorted(accel))}); the engine keeps "
                         f"its KV cache on one device: use one accelerator plus cpu/disk")
    main = torch.device(next(iter(accel))) if accel else torch.device("cpu")
    if device is not None and accel and torch.device(device).type == "cpu":
        raise ValueError(f"device_map: places modules on {main}, but device is cpu")
    if "disk" in dmap.values() and offload_folder is None:
        offload_folder = tempfile.mkdtemp(prefix="unmask-offload-")
    try:
        dispatch_model(model, device_map=dmap, main_device=str(main), offload_dir=offload_folder)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"device_map: {exc}") from exc
    # the engine calls the decoder stack and the LM head separately: each returns its output where its input was
    for module in (model.base_model, model.get_output_embeddings()):
        add_hook_to_module(module, AlignDevicesHook(io_same_device=True), append=True)
    loaded.device = main
    loaded.device_map = dmap
    loaded.offload_folder = None if offload_folder is None else str(offload_folder)
    loaded.refresh_head()
    return dmap
