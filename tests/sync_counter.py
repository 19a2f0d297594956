"""Host syncs and the ops outside the model forward, counted on a CPU (issue 42; ``benchmarks/bench_step_syncs.py``).

:class:`SyncCounter` counts, while it is entered, what would block the host on a GPU, by kind:

* ``host read``: ``Tensor.item/tolist/numpy/cpu/__bool__/__int__/__float__/__index__`` of a device tensor (a
  device-to-host copy; counted once, the ops they dispatch are not counted again);
* ``value read``: the aten ops that read a value (``_local_scalar_dense``, ``equal``, ``is_nonzero``) outside those;
* ``data-dependent shape``: ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size`` (the output's size must reach the host);
* ``boolean-mask index``: ``x[mask]`` / ``x[mask] = v`` with a bool index (``aten.index`` / ``index_put`` run a
  ``nonzero`` on the device);
* ``device-to-host`` / ``host-to-device``: blocking copies between the device and the CPU (``non_blocking=True``
  copies are not counted), including tensors built from host data on the device (``torch.tensor(..., device=)``).
  Visible only when tensors carry another device than the CPU (under :func:`device_tags.fake_cuda`, or on a GPU).
  Not counted: a CPU index tensor used to index a device tensor (CUDA copies it too).

Under ``torch.inference_mode`` an op on plain CPU tensors never reaches a dispatch mode, so ``ops_outside`` counts the
ops on device tensors (under fake CUDA: the kernel launches a GPU would see) plus CPU ops outside inference mode.

"Device" is ``device_type``: ``"cuda"`` under fake CUDA (CPU-side bookkeeping tensors are then not counted), or
``"cpu"`` to count every tensor (a plain CPU run: an upper bound). It also counts every aten op dispatched outside
the methods marked with :meth:`SyncCounter.forward_methods` (the model forward) and, with
:meth:`SyncCounter.step_method`, records both per call of a step method (one batch step of the engine).

The counter is a ``TorchDispatchMode`` plus a ``TorchFunctionMode``; enter it inside ``fake_cuda`` (it then sees the
ops before the fake device runs them).
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
DATA_DEPENDENT_FUNCTIONS = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                            torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                            torch.Tensor.unique_consecutive, torch.argwhere, torch.Tensor.argwhere}
VALUE_READ_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
DATA_DEPENDENT_OPS = {aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
                      aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                      aten.argwhere.default}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten.copy.default}
BUILDERS = {torch.tensor, torch.as_tensor, torch.asarray}


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _has_bool_index(index) -> bool:
    return any(t.dtype == torch.bool for t in _tensors(index))


class _Functions(TorchFunctionMode):
    """Python-level reads and data-dependent calls (counted once; the ops below them are not counted again)."""

    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        kind = None
        if c.quiet == 0 and args and isinstance(args[0], torch.Tensor) and c.on_device(args[0]):
            if func in HOST_READS:
                kind = "host read"
            elif func in DATA_DEPENDENT_FUNCTIONS:
                kind = "data-dependent shape"
            elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_bool_index(args[1]):
                kind = "boolean-mask index"
        elif c.quiet == 0 and c.device_type != "cpu" and self._to_device(func, args, kwargs):
            kind = "host-to-device"
        if kind is None:
            return func(*args, **kwargs)
        c.count(kind)
        c.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            c.quiet -= 1


    def _to_device(self, func, args, kwargs) -> bool:
        """Whether ``func`` is a blocking host-to-device copy: a tensor built from host data on the device
        (``torch.tensor(..., device=)``), or ``Tensor.to/cuda`` of a CPU tensor (caught here because under
        ``torch.inference_mode`` the copy of a plain CPU tensor never reaches a dispatch mode)."""
        if kwargs.get("non_blocking"):
            return False
        target = kwargs.get("device")
        if func in BUILDERS:
            pass
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "cpu":
            if func is torch.Tensor.cuda:
                target = "cuda"
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    target = a.device
                elif isinstance(a, (str, torch.device)):
                    target = a
                elif a is True:  # to(device, dtype, non_blocking)
                    return False
        else:
            return False
        if target is None or isinstance(target, int):
            return False
        try:
            return torch.device(target).type == self.counter.device_type
        except (RuntimeError, TypeError):
            return False


class _Dispatch(TorchDispatchMode):
    """aten-level blocking ops and the op count."""

    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if c.in_forward:
            c.ops_inside += 1
        else:
            c.ops_outside += 1
        if c.quiet == 0:
            kind = self._kind(func, args, kwargs)
            if kind is not None:
                c.count(kind)
        out = func(*args, **kwargs)
        if not c.in_forward and any(c.on_device(t) for t in _tensors((args, kwargs, out))):
            c.device_ops_outside += 1  # a kernel launch a GPU would see
        return out

    def _kind(self, func, args, kwargs) -> str | None:
        c = self.counter
        tensors = _tensors((args, kwargs))
        if func in COPY_OPS:
            return self._copy_kind(func, args, kwargs)
        if not any(c.on_device(t) for t in tensors):
            return None
        if func in VALUE_READ_OPS:
            return "value read"
        if func in DATA_DEPENDENT_OPS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            return "data-dependent shape"
        if func in INDEX_OPS and _has_bool_index(args[1]):
            return "boolean-mask index"
        return None

    def _copy_kind(self, func, args, kwargs) -> str | None:
        if kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2]):
            return None
        if func is aten._to_copy.default:
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
        else:
            dst, src = args[0].device, args[1].device
        device = self.counter.device_type
        if device == "cpu" or src.type == dst.type:
            return None
        if src.type == device and dst.type == "cpu":
            return "device-to-host"
        if src.type == "cpu" and dst.type == device:
            return "host-to-device"
        return None


class SyncCounter:
    """Counts host syncs (``syncs``: kind -> count) and aten ops (``ops_outside`` / ``ops_inside`` the marked forward
    methods) while entered (``with SyncCounter() as c:``); ``steps`` holds one record per call of the method given
    to :meth:`step_method`: ``{"syncs": {kind: n}, "forward_syncs": {kind: n}, "ops_outside": n, ...}``
    (``forward_syncs``: the part of ``syncs`` made inside the forward methods, e.g. an MoE layer's expert counts).

    Args:
        device_type: the device whose tensors count (``"cuda"`` under fake CUDA; ``"cpu"``: every tensor).
    """

    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type
        self.syncs: Counter[str] = Counter()
        self.forward_syncs: Counter[str] = Counter()  # the part of ``syncs`` made inside the marked forward methods
        self.ops_outside = 0
        self.device_ops_outside = 0  # ops outside the forward on a device tensor (in or out): kernel launches
        self.ops_inside = 0
        self.steps: list[dict] = []
        self.quiet = 0
        self._forward_depth = 0
        self._stack = contextlib.ExitStack()

    @property
    def in_forward(self) -> bool:
        return self._forward_depth > 0

    @property
    def total(self) -> int:
        """Every sync counted so far."""
        return sum(self.syncs.values())

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def count(self, kind: str) -> None:
        self.syncs[kind] += 1
        if self.in_forward:
            self.forward_syncs[kind] += 1

    def reset(self) -> None:
        self.syncs.clear()
        self.forward_syncs.clear()
        self.ops_outside = self.ops_inside = self.device_ops_outside = 0
        self.steps.clear()

    def __enter__(self) -> "SyncCounter":
        self._stack.enter_context(_Functions(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def forward_methods(self, cls, names: tuple[str, ...]) -> Iterator[None]:
        """While inside, calls of ``cls.<name>`` for ``name`` in ``names`` count as the model forward: their ops go to
        ``ops_inside`` and their syncs still count (a sync in the forward is a sync)."""
        with _patched(cls, names, self._forward_wrapper):
            yield

    @contextlib.contextmanager
    def step_method(self, cls, name: str) -> Iterator[None]:
        """While inside, each call of ``cls.<name>`` (one batch step) appends its syncs and ops outside the forward to
        ``steps``."""
        with _patched(cls, (name,), self._step_wrapper):
            yield

    def _forward_wrapper(self, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            self._forward_depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._forward_depth -= 1
        return wrapper

    def _step_wrapper(self, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            syncs, fwd, ops, dev_ops = (Counter(self.syncs), Counter(self.forward_syncs), self.ops_outside,
                                        self.device_ops_outside)
            try:
                return method(*args, **kwargs)
            finally:
                delta, fwd_delta = Counter(self.syncs), Counter(self.forward_syncs)
                delta.subtract(syncs)
                fwd_delta.subtract(fwd)
                self.steps.append({"syncs": {k: v for k, v in delta.items() if v},
                                   "forward_syncs": {k: v for k, v in fwd_delta.items() if v},
                                   "ops_outside": self.ops_outside - ops,
                                   "device_ops_outside": self.device_ops_outside - dev_ops})
        return wrapper


@contextlib.contextmanager
def _patched(cls, names, wrap) -> Iterator[None]:
    originals = {n: cls.__dict__[n] for n in names}
    try:
        for n, f in originals.items():
            setattr(cls, n, wrap(f))
        yield
    finally:
        for n, f in originals.items():
            setattr(cls, n, f)
