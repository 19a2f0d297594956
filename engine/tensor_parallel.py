"""Tensor parallelism over N processes with torch.distributed (docs/design.md#scale-out; ``unmask serve
--tensor-parallel-size N``).

Sharding (:func:`shard_model`): PyTorch's ``parallelize_module`` on every decoder layer of the transformers module
(every family loads as Llama or Qwen2 modules): q/k/v and gate/up projections split by output columns (``Colwise``:
each rank computes its share of the attention heads and of the MLP's hidden units), o and down projections by
input rows (``Rowwise``: partial sums, one all-reduce each), embeddings, norms and the LM head replicated. So each
rank's attention sees its own heads only and the engine's KV cache, filled by the attention's keys/values, holds
``H_kv / N`` heads per rank without any change to it. Weights run natively (packed fp16/int8/int4 kernels are not
sharded).

Stepping together (SPMD, driven by rank 0): the engine is deterministic given the calls it receives (which requests
are enqueued with which resolved plans, aborts, steps, scoring jobs), so every rank runs the same
:class:`~unmask.engine.engine.Engine` and rank 0 publishes each call before making it (:func:`publish_calls`);
the other ranks replay them (:func:`follow`). Every rank then holds the same scheduler state, the same canvases,
the same prefix-cache chains and its own head shard of every KV cache; the all-reduces inside each forward give all
ranks the same hidden states, hence the same logits and the same sampled tokens. The requests' plans travel
resolved (seed included), so a request without a seed draws it once, on rank 0.

Channels: the calls go over a gloo group with no practical timeout (an idle server sends nothing), the forwards'
collectives over the default group with ``timeout`` seconds: a rank that dies mid-request fails rank 0's next
collective (gloo sees the closed connection at once, else the timeout), the engine stops with
:class:`TensorParallelError` and ``unmask serve`` exits with that message. A rank whose rank 0 dies sees its
channel close and exits.
"""
from __future__ import annotations

import datetime
import logging

import torch

__all__ = ["TensorParallelError", "init_group", "shard_model", "publish_calls", "follow", "stop_followers",
           "check_shardable", "rank_device", "DEFAULT_TIMEOUT_S"]

log = logging.getLogger("unmask.engine")

DEFAULT_TIMEOUT_S = 60.0
#: the control channel's timeout: effectively none (an idle server publishes nothing)
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: sharding of one decoder layer (transformers' Llama / Qwen2 module names; transformers' own tp_plan for them)
_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
         "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
         "mlp.down_proj": "rowwise"}


class TensorParallelError(BaseException):
    """A rank of the tensor-parallel group failed or left (a collective raised or timed out). A ``BaseException``:
    no rank can step alone, so nothing between the collective and the engine thread's end may catch it as one
    request's error (the engine thread stops, its requests get ``EngineClosed``, ``unmask serve`` exits 1)."""


class _Group:
    """This process's place in the group: rank, size, the control channel."""

    def __init__(self, rank: int, world: int, control):
        self.rank, self.world, self.control = rank, world, control


_group: _Group | None = None


def init_group(rank: int, world: int, address: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S,
               device: str = "cpu") -> _Group:
    """Join the group (``tcp://address:port``; gloo on CPU, NCCL on CUDA) with ``timeout_s`` for the forwards'
    collectives, and make the control channel."""
    import torch.distributed as dist

    global _group
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _group = _Group(rank, world, control)
    return _group


def check_shardable(hf_config, world: int) -> None:
    """Refuse a model whose heads or MLP width do not split evenly.

    Raises:
        ValueError: naming ``tensor_parallel_size``, the dimension and both numbers.
    """
    dims = {"attention heads": hf_config.num_attention_heads,
            "key/value heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            "MLP width": hf_config.intermediate_size}
    for what, n in dims.items():
        if n % world:
            raise ValueError(f"tensor_parallel_size: {world} does not divide the model's {n} {what}")


def shard_model(loaded, world: int) -> None:
    """Shard ``loaded``'s decoder layers over the group (in place; every rank calls it with the same model).

    Raises:
        ValueError: a model that cannot be sharded: dimensions (:func:`check_shardable`), packed weights, a row
            variant (mask-row adapter, verifier) or a device map (names ``tensor_parallel_size``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if loaded.weight_format != "native":
        raise ValueError(f"tensor_parallel_size: weights {loaded.weight_format!r} are packed, which is not sharded; "
                         "use --weights native")
    if loaded.row_variant is not None:
        raise ValueError("tensor_parallel_size: a mask-row adapter or verifier is not sharded; serve without it")
    if getattr(loaded.model, "hf_device_map", None):
        raise ValueError("tensor_parallel_size: a device map and tensor parallelism do not combine")
    check_shardable(loaded.model.config, world)
    mesh = init_device_mesh(loaded.device.type, (world,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in _PLAN.items()}
    for layer in loaded.model.base_model.layers:
        parallelize_module(layer, mesh, plan)


# ---------------------------------------------------------------------------------------------- stepping together
def _send(obj) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([obj], src=0, group=_group.control)


def _receive():
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=_group.control)
    return box[0]


def _encode_enqueue(reqs) -> tuple:
    """One request's choices as what rebuilds them on another rank: prompt ids, choice 0's resolved plan (seed
    included), id, n, fairness group, cache salt."""
    first = reqs[0]
    return (list(first.prompt_ids), first.plan, first.request_id, len(reqs), first.group, first.cache_salt)


def publish_calls(engine) -> None:
    """Make rank 0's ``engine`` (an :class:`~unmask.engine.engine.Engine`) publish ``enqueue``, ``abort``,
    ``step`` and ``score`` on the control channel before running each (instance attributes over the class's
    methods: the engine's code is unchanged). A call that cannot be published, or whose collectives fail (a peer
    gone, the timeout), raises :class:`TensorParallelError`; the engine's own errors (a ``ParamError``) pass."""
    for name in ("enqueue", "abort", "step", "score"):
        original = getattr(engine, name)

        def call(*args, _name=name, _original=original, **kw):
            try:
                payload = _encode_enqueue(args[0]) if _name == "enqueue" else (args, kw, _state(engine))
                _send((_name, payload))
            except Exception as exc:
                raise _failed(_name, exc) from exc
            try:
                return _original(*args, **kw)
            except Exception as exc:
                if _collective_error(exc):
                    raise _failed(_name, exc) from exc
                raise
        setattr(engine, name, call)


def _failed(call: str, exc: BaseException) -> TensorParallelError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return TensorParallelError(f"the tensor parallel group failed during {call}: {type(exc).__name__}: {first}")


def _collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a collective (a peer gone, a timeout) rather than the model or the request."""
    text = f"{type(exc).__name__} {exc}".lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "distbackend", "peer"))


def _state(engine) -> tuple:
    """What every rank's engine must agree on before a call: the running and waiting sequences, in order."""
    sched = engine.scheduler
    return (tuple((s.request_id, s.index) for s in sched.running),
            tuple((s.request_id, s.index) for s in sched.waiting))


def stop_followers() -> None:
    """Tell the other ranks to exit (rank 0, at shutdown; a failed group is left alone)."""
    try:
        _send(None)
    except Exception:  # the group is already broken: the others exit on their own
        pass


def follow(engine) -> None:
    """Replay rank 0's calls on this rank's ``engine`` until rank 0 says stop (or its channel closes, which
    raises)."""
    from .engine import make_requests

    while True:
        message = _receive()
        if message is None:
            return
        name, payload = message
        if name == "enqueue":
            ids, plan, rid, n, group, salt = payload
            reqs = make_requests(engine.model, ids, plan.params, rid, n, engine.defaults, plan=plan)
            for r in reqs:
                r.group, r.cache_salt = group, salt
            engine.enqueue(reqs)
        else:
            args, kw, state = payload
            if _state(engine) != state:  # a rank that stepped otherwise would all-reduce other rows: stop instead
                raise TensorParallelError(f"rank {_group.rank} diverged from rank 0 before {name}: "
                                          f"{_state(engine)} != {state}")
            getattr(engine, name)(*args, **kw)


def follower_exit_code(exc: BaseException) -> int:
    """Log why a follower stops and return its exit status (1)."""
    log.error("tensor parallel rank %d stops: %s: %s", _group.rank if _group else -1, type(exc).__name__,
              str(exc).splitlines()[0] if str(exc) else "")
    return 1


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: ``cuda`` / ``auto`` with CUDA -> ``cuda:<rank>``; a CPU stays ``cpu``."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{rank}"
