"""Loading a diffusion model: :func:`load_model` returns a :class:`~unmask.engine.loaded.LoadedModel` (the
transformers module, its tokenizer and its :class:`DllmConfig`, frozen after load: the decoding plan decides every
default from it), and the device and dtype rules.

``load_model`` detects the family (``config.json`` ``dllm.family``; foreign checkpoints by ``architectures`` /
``model_type``; ``family=`` overrides) and hands over to the family adapter in ``unmask.engine.families``.
The denoiser only calls :meth:`LoadedModel.hidden_states`, :meth:`LoadedModel.logits` (and once
:meth:`LoadedModel.enable_compile`).

Optional capabilities, one seam each (docs/design.md#extensions-and-seams); the core path reads the same without them:

* per-row weight selection: a :class:`RowVariant` (``LoadedModel.row_variant``, ``variant_rows=``). Verifier
  routing (:mod:`unmask.engine.routed`) is its first implementation, the mask-row adapter
  (:mod:`unmask.engine.mask_adapter`) the second (see :class:`RowVariant`);
* CPU weight packing: :func:`unmask.engine.packed_weights.pack_model` (``load_model(weights=...)`` calls it once),
  which also installs the fused decoder forward (``LoadedModel.decoder_forward``,
  :mod:`unmask.engine.fused_decoder`) for Llama-architecture models.

Whether checkpoint-default speculative requests draft is not the model's business: the engine's decoding plan
decides it from the engine option ``default_drafts`` and :attr:`LoadedModel.device`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .lane_attention import use_lanes
from .config import OWN_FORWARD_FAMILIES, CheckpointError
from .loaded import LoadedModel, RowVariant, read_config  # noqa: F401 (re-exported: their home is unmask.engine.loaded)


def auto_device() -> torch.device:
    """What ``auto`` means: CUDA when available, else the CPU. The one place that decides it (every ``auto``
    default goes through :func:`resolve_device`; the tests pin it to the CPU: tests/conftest.py)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    note = cuda_unusable_note()
    if note:  # one line: a GPU this torch cannot use is a mis-install, not a choice
        logging.getLogger("unmask.engine").warning("device auto: the CPU, %s", note)
    return torch.device("cpu")


#: Where a loaded NVIDIA kernel driver states its version (Linux).
NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA driver's version (``'550.54.15'``), from :data:`NVIDIA_PROC_VERSION`, else from
    ``nvidia-smi``; None when there is none (a file test and a PATH lookup on such a machine)."""
    import re
    import shutil
    import subprocess

    try:
        m = re.search(r"Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", NVIDIA_PROC_VERSION.read_text() + " ")
        if m:
            return m.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = r.stdout.split()
        if r.returncode == 0 and lines:
            return lines[0]
    return None


def cuda_unusable_note() -> str | None:
    """One line when an NVIDIA driver is loaded but this torch cannot use CUDA, naming the driver and torch's build
    (a CPU build; a CUDA build the driver is too old for: 13.x needs >= 580, 12.x >= 525.60.13; else no GPU visible
    to the process); None when no driver is loaded. Fix: docs/deploy.md, "Which torch build"."""
    driver = nvidia_driver_version()
    if driver is None:
        return None
    cuda = torch.version.cuda
    need = {"13": (580,), "12": (525, 60, 13)}.get(str(cuda).split(".")[0]) if cuda else None
    try:
        have = tuple(int(p) for p in driver.split("."))
    except ValueError:
        have = None
    if not cuda:
        why = "a CPU build"
    elif need and have and have < need:
        why = f"a CUDA {cuda} build, which needs driver >= {'.'.join(map(str, need))}"
    else:
        why = f"a CUDA {cuda} build, yet sees no GPU (CUDA_VISIBLE_DEVICES? a container without --gpus?)"
    return (f"though an NVIDIA GPU is present (driver {driver}): torch {torch.__version__} is {why}; "
            "./scripts/setup.sh installs the build this driver runs (docs/deploy.md, \"Which torch build\")")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or None) -> :func:`auto_device`. Raises ``ValueError`` for an unknown device string, an absent
    CUDA device, and ``mps`` (the sampler draws float64, which MPS lacks)."""
    if device is None or str(device) == "auto":
        return auto_device()
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            note = cuda_unusable_note()
            raise ValueError(f"device: {device!r} requested but CUDA is not available "
                             + (note if note else f"(this torch: {torch.__version__})"))
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} but only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        raise ValueError(f"device: {device!r} is not supported: the sampler draws in float64, which MPS lacks; "
                         "use cpu")
    elif dev.type != "cpu":
        raise ValueError(f"device: {device!r} is not one of auto, cpu, cuda, cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA with bf16 support, float16 on other CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


def resolve_model_path(name_or_path: str) -> Path:
    """A local directory as is (a training output directory resolves to its ``latest`` checkpoint); an
    ``org/name`` hub id through huggingface_hub (uses the local cache offline).

    Raises:
        CheckpointError: neither a directory nor a resolvable hub id.
    """
    p = Path(name_or_path).expanduser()
    if p.is_dir() and not (p / "config.json").exists() and (p / "latest").is_file():
        # a training OUT directory: its `latest` file names the newest checkpoint-<step>
        latest = p / (p / "latest").read_text().strip()
        if latest.is_dir():
            return latest
    if p.exists():
        return p
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path))
        except Exception as exc:  # network or cache miss
            raise CheckpointError(f"{name_or_path}: not a local directory and not downloadable from the hub ({exc})") from exc
    raise CheckpointError(f"{name_or_path}: no such directory")


def load_model(name_or_path: str | os.PathLike, family: str | None = None, device: str = "auto",
               dtype: str = "auto", weights: str = "auto", device_map: str | dict | None = None,
               max_memory: str | dict | None = None, offload_folder: str | None = None,
               adapter: str | os.PathLike | None = None, parent: str | os.PathLike | None = None,
               max_weight_magnitude: float | None = None) -> LoadedModel:
    """Load any supported dLLM checkpoint.

    Args:
        name_or_path: a checkpoint directory, a LLaDA or Dream GGUF file, or a hub id where a network (or the
            local hub cache) exists.
        family: force a family (``a2d``, ``llada``, ``dream``, ``fast_dllm_v2``, ``sdar``); default: detect.
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``. dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        weights: how the linear layers run (:mod:`unmask.engine.packed_weights`): ``auto`` (fbgemm-packed fp16 on
            a CPU with fbgemm, int4 for weights on a 4-bit grid, else as loaded), ``native`` (as loaded: float32/bf16, or bitsandbytes nf4/int8),
            ``fp16``. Inference only: train from a ``native`` load.
        device_map, max_memory, offload_folder: split the layers between a device, CPU memory and disk with
            accelerate (:func:`unmask.engine.placement.place_model`; ``auto`` weights then stay ``native``).

        adapter: a mask-row adapter directory to put on the checkpoint (docs/design.md#mask-row-adapter); a
            self-contained or adapter-only ``name_or_path`` needs none. parent: an adapter-only checkpoint's parent
            directory (default: the adapter's ``parent.name`` hint).
        max_weight_magnitude: the largest weight magnitude accepted in the checkpoint and the adapter (default
            :data:`unmask.engine.limits.MAX_WEIGHT_MAGNITUDE`; 0 = no bound; docs/design.md#checks-at-load).


    Raises:
        CheckpointError: (one line, naming the file) the directory is not a checkpoint of a known family, or it is
            corrupt, incomplete, a writer's staging directory, or holds non-finite weights
            (:mod:`unmask.engine.checkpoint_check`, docs/design.md#checks-at-load); an adapter whose parent hash
            differs from the checkpoint's (docs/design.md#mask-row-adapter).
        ValueError: a bad ``device``, ``dtype`` or ``weights``, or ``max_memory`` / ``offload_folder`` without
            ``device_map`` (the message names it).
    """
    from .checkpoint_check import load_checked
    from .families import detect_family, get_family

    from .adapter_files import apply_adapter, resolve_adapter

    from .gguf_file import is_gguf_file

    path, adapter_dir = resolve_adapter(resolve_model_path(str(name_or_path)), adapter, parent)
    gguf = is_gguf_file(path)  # a LLaDA / Dream GGUF (docs/design.md#model-families, "GGUF files")
    config = {} if gguf else read_config(path)
    name = family if gguf else family or detect_family(config, path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    from .heap import return_freed_memory
    from .packed_weights import pack_model, resolve_weight_format

    for option, value in (("max_memory", max_memory), ("offload_folder", offload_folder)):
        if value is not None and device_map is None:  # would be ignored: say so instead
            raise ValueError(f"{option}: applies only with device_map (auto | balanced | sequential, or a map); "
                             "set device_map or drop it")
    if device_map is not None and weights in (None, "auto"):
        weights = "native"  # offloaded weights run as loaded (docs/design.md#scale-out)
    fmt = resolve_weight_format(weights, dev, dt)  # bad values fail before the weights are read
    if device_map is not None and fmt != "native":
        raise ValueError(f"weights: {fmt!r} packing cannot be combined with device_map (use weights='native')")
    # refuses corrupt checkpoints (docs/design.md#checks-at-load)
    # with a device map the weights stay on the CPU until accelerate dispatches them: a model larger than the
    # device must never be moved there whole (docs/design.md#scale-out)
    load_device = torch.device("cpu") if device_map is not None else dev
    from .limits import MAX_WEIGHT_MAGNITUDE

    bound = MAX_WEIGHT_MAGNITUDE if max_weight_magnitude is None else max_weight_magnitude
    if gguf:
        from .families.gguf_checkpoint import load_gguf

        loaded = load_gguf(path, name, load_device, dt, max_magnitude=bound)
    else:
        loaded = load_checked(get_family(name), path, config, load_device, dt, max_magnitude=bound)
    if device_map is not None:
        from .placement import place_model

        place_model(loaded, device_map, max_memory, offload_folder, device=dev)
    if loaded.dllm.family in OWN_FORWARD_FAMILIES:  # its own forward, as loaded (docs/design.md#model-families)
        if fmt != "native" and weights not in (None, "auto"):
            raise ValueError(f"weights: {loaded.dllm.family} runs its weights as loaded (native), got {weights!r}")
        if adapter_dir is not None:
            raise ValueError(f"adapter: a mask-row adapter needs mask rows; {loaded.dllm.family} has none")
    else:
        pack_model(loaded, "auto" if (weights or "auto") == "auto" else fmt)  # auto's int4 case reads the weights
        apply_adapter(loaded, adapter_dir, max_magnitude=bound)  # the mask-row adapter (docs/design.md#mask-row-adapter), after packing
        use_lanes(loaded)  # attention over each lane's own keys, no cache copies (docs/design.md#decoding, "KV cache")
    return_freed_memory()  # the adapter's float32 read copies
    loaded.dllm.freeze()  # the plan decides the defaults from these settings; nothing changes them (#decoding)
    return loaded
