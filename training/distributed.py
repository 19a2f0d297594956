"""Sharded multi-process training (FSDP2): a model whose weights, gradients and optimizer state do not fit one
device is split across the processes of an ``accelerate launch`` / ``torchrun`` job (docs/design.md#scale-out).

``unmask train --fsdp`` under N processes shards every parameter of each decoder layer, and of the rest of the model
(embedding, final norm, LM head), across the N processes with PyTorch's FSDP2 ``fully_shard`` (Zhao et al. 2023,
"PyTorch FSDP", arXiv:2304.11277; the per-parameter DTensor sharding of ``torch.distributed.fsdp``): each process
holds 1/N of the weights, gradients and AdamW state; a layer's weights are all-gathered for its forward and
backward and its gradients reduce-scattered after. Each process trains its own micro-batches, as under DDP, so the
loss is the single-process one (the trainer seeds each micro-batch's noise by its global index;
docs/design.md#scale-out).

Why not accelerate's FSDP plugin: accelerate (1.x, ``accelerate/state.py``) turns ``ACCELERATE_USE_FSDP`` /
``fsdp_plugin`` on only for accelerator backends (``MULTI_GPU``, ``MULTI_NPU``, ...), never for ``MULTI_CPU``, so
the plugin cannot shard a CPU (gloo) job. This module makes the call accelerate's FSDP2 plugin makes
(``fully_shard`` per transformer block, then the root) itself, on the device mesh of accelerate's process group,
so the same code path runs under gloo on CPUs (tested) and NCCL on GPUs; accelerate still launches the processes,
owns the process group, the optimizer wrapper, ``backward`` and the reductions.

Checkpoints are full state dicts (``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True,
cpu_offload=True``): every process joins the gather, process 0 writes a plain servable checkpoint that the engine
loads, and a full optimizer state that ``--resume`` re-shards.

Scope: ``--trainable full`` only (the case that needs sharding; the other scopes keep frozen rows with gradient hooks
that index whole matrices, which a shard does not hold).
"""
from __future__ import annotations

import torch


class FsdpError(ValueError):
    """``--fsdp`` with a setting it cannot run (the message names the option)."""


def check_fsdp(trainable: str) -> None:
    """Raise :class:`FsdpError` naming the option when ``--fsdp`` cannot shard this scope (an objective that cannot
    run sharded says so itself: ``Objective.fsdp_refusal``)."""
    if trainable != "full":
        raise FsdpError(f"--fsdp: needs --trainable full (got {trainable!r}: the other scopes restrict rows of "
                        f"whole matrices with gradient hooks, which a shard does not hold)")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers causal LM (``model.base_model.layers``), FSDP's wrapping units.

    Raises:
        FsdpError: the model has no ``layers`` list.
    """
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise FsdpError(f"--fsdp: {type(model).__name__} has no decoder `layers` to shard")
    return list(layers)


def shard_model(root: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> bool:
    """Shard ``model`` (a transformers causal LM inside ``root``, the module the training loop calls) in place
    across the processes of the current process group: one FSDP2 unit per decoder layer, and ``root`` for the rest
    (embedding, norm, head: the root must be the called module, since the loss forward calls the decoder stack and
    the head separately, never ``model.forward``). The parameters become DTensors (same names). Returns False
    (nothing done) in a single-process run. Build the optimizer after this call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return True


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def as_float(x) -> float:
    """A scalar tensor, or a DTensor (the total gradient norm of sharded parameters), as a Python float."""
    full = getattr(x, "full_tensor", None)
    return float(full() if full is not None else x)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_states(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """``(model state dict, optimizer state dict)`` of the sharded root ``model``, full (unsharded) on the CPU on
    process 0 (empty elsewhere). A collective: every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
    return get_model_state_dict(model, options=_options()), get_optimizer_state_dict(model, opt, options=_options())


def load_full_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Re-shard a full optimizer state (from :func:`full_states`, every process passes the same) into
    ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    opt = getattr(optimizer, "optimizer", optimizer)
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def servable_model(source: str, state: dict, prefix: str = "lm.") -> torch.nn.Module:
    """A plain float32 transformers model on the CPU (``source``'s architecture) holding the full ``state`` (the
    root's state dict: the causal LM's names under ``prefix``, the trainer's ``DiffusionForward.lm``)."""
    from .scopes import load_source

    state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    model, _, _ = load_source(source, device="cpu", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if n.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"--fsdp: the gathered state does not match {source} (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")
    return model.eval()
