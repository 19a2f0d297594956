"""Fake CUDA on a CPU-only build: tensors keep real CPU storage and values but carry a ``cuda`` device tag, and an
operation that mixes devices the way CUDA refuses raises as it would on a GPU.

PyTorch's own fake tensors catch mixed devices too but hold no values, so they cannot run a decode loop (it reads
values every step). Here every op runs for real on the CPU, so a whole request can decode under :func:`fake_cuda`
and its tokens compared with a plain CPU run.

The rule checked (what CUDA's kernels enforce): the tensors of one op are on one device, except that a 0-dim CPU
tensor may join CUDA tensors (a scalar), indices of ``index``/``index_put_`` may stay on the CPU, ``copy_``/``to``
move data between devices, and a random op's generator is on the op's device. A violation raises
:class:`MixedDeviceError` naming the op and the devices.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from types import SimpleNamespace
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
DATA = torch._C.TensorBase.__dict__["data"]
aten = torch.ops.aten

# ops whose index tensors may be on the CPU while the indexed tensor is on CUDA (advanced indexing)
CPU_INDICES_OK = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# ops that move data between devices
TRANSFERS = {aten._to_copy.default, aten.to.device, aten.to.dtype_layout, aten.to.other, aten.copy_.default,
             aten.copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}


# reads of a device tensor's values on the host (each a device-to-host copy and a sync on a GPU); C++ enters a
# CUDA device guard for them before any dispatch, so they run on the CPU storage here
HOST_READS = {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__,
              torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__format__}


# ops whose output shape depends on the values: a sync on a GPU
DATA_DEPENDENT = {torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
                  torch.Tensor.unique, torch.unique, torch.Tensor.unique_consecutive, torch.unique_consecutive}


class MixedDeviceError(RuntimeError):
    """An operation mixed tensors of two devices (CUDA would raise: 'Expected all tensors to be on the same
    device')."""


class Tagged(torch.Tensor):
    """A CPU tensor (``inner``) that reports ``device`` ``cuda:0``."""

    _cpu_storage: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device | None = None, requires_grad: bool = False):
        # ``type(t)(value, requires_grad=...)`` (accelerate re-creates parameters by their class) lands here too
        device = device or (inner.device if isinstance(inner, Tagged) or inner.device.type == "meta" else FAKE)
        inner = _unwrap(inner)
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                layout=inner.layout, device=device,
                                                requires_grad=inner.requires_grad)
        r._cpu_storage = inner
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Tagged({self._cpu_storage!r}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # only reached outside fake_cuda()
        raise RuntimeError(f"{func}: a fake-CUDA tensor used outside fake_cuda()")


def _device_of(t: torch.Tensor) -> torch.device:
    return t.device


def _as_device(value) -> torch.device | None:
    if value is None:
        return None
    return torch.device(value) if not isinstance(value, torch.device) else value


def _normal(dev: torch.device) -> torch.device:
    return FAKE if dev.type == "cuda" else dev


class _FakeCudaDispatch(TorchDispatchMode):
    """Runs every op on the CPU; checks devices; tags results."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        target = self._target(func, args, kwargs, tensors)
        self._count_sync(func, args, tensors, target)
        gen = kwargs.get("generator")
        if gen is not None and _normal(gen.device) != target:
            raise MixedDeviceError(f"{func}: a {gen.device} generator for a tensor on {target} (CUDA raises: "
                                   f"'Expected a {target.type} device type for generator')")
        if func is aten.to.other:  # to(other): other's device
            func, args = aten._to_copy.default, (args[0],)
        unwrapped_args, unwrapped_kwargs = tree_map(lambda x: _on_cpu(_unwrap(x)), (args, kwargs))
        try:
            out = func(*unwrapped_args, **unwrapped_kwargs)
        except NotImplementedError as exc:  # a CUDA-typed tensor without CPU storage reached a kernel
            kinds = [f"{type(t).__name__}@{t.device}" for t in tree_flatten((unwrapped_args, unwrapped_kwargs))[0]
                     if isinstance(t, torch.Tensor)]
            raise RuntimeError(f"fake CUDA: {func} got {kinds}") from exc
        if target.type != "cuda":
            return out
        inners = {id(_unwrap(t)): t for t in tensors if _unwrap(t) is not t}
        # a view of a normal tensor (a parameter) made in inference mode is a normal tensor sharing its base's version
        # counter, as on a real device: the wrapper must not be born an inference tensor
        normal_view = func.is_view and torch.is_inference_mode_enabled() and any(
            not t.is_inference() for t in tensors)

        def tag(o):
            if not isinstance(o, torch.Tensor):
                return o
            same = inners.get(id(o))  # an in-place op or an out= argument returns its input
            if same is not None:
                return same
            if normal_view:
                with torch.inference_mode(False):
                    return Tagged(o, target)
            return Tagged(o, target)

        return tree_map(tag, out)

    def _count_sync(self, func, args, tensors: list[torch.Tensor], target: torch.device) -> None:
        """Count what blocks the host on a GPU: device-to-host copies, value reads, data-dependent shapes, and
        host-to-device copies of pageable memory (``syncs[kind]``)."""
        on_cuda = any(_normal(t.device).type == "cuda" for t in tensors)
        if func in TRANSFERS and tensors:
            src = _normal((args[1] if func in (aten.copy_.default, aten.copy.default) else args[0]).device)
            if src.type == "cuda" and target.type == "cpu":
                self.syncs["device-to-host"] += 1
            elif src.type == "cpu" and target.type == "cuda" and args[-1 if func is aten.copy_.default else 0].dim():
                self.syncs["host-to-device"] += 1
        elif on_cuda and func in (aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default):
            self.syncs["value read"] += 1
        elif on_cuda and func in (aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor):
            self.syncs["data-dependent shape"] += 1

    @staticmethod
    def _target(func, args, kwargs, tensors: list[torch.Tensor]) -> torch.device:
        """The device of ``func``'s result, after checking that its tensors may meet."""
        explicit = _as_device(kwargs.get("device"))
        if explicit is None:
            explicit = next((a for a in args if isinstance(a, torch.device)), None)
        if func in TRANSFERS or func is torch.Tensor.copy_:  # copy_: a Python binding (a device guard first)
            if func is aten.to.other:
                return _normal(args[1].device)
            if func in (aten._to_copy.default, aten.to.device, aten.to.dtype_layout):
                return _normal(explicit) if explicit is not None else _normal(args[0].device)
            return _normal(args[0].device)  # copy_(dst, src): dst's device
        if func is aten._local_scalar_dense.default or not tensors:
            return _normal(explicit) if explicit is not None else torch.device("cpu")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        devices = set()
        for t in tensors:
            dev = _normal(t.device)
            if dev.type == "cpu" and t.dim() == 0:
                continue  # a CPU scalar joins any device
            if func in CPU_INDICES_OK and dev.type == "cpu" and t is not first and t.dtype in (torch.long, torch.int,
                                                                                             torch.bool):
                continue  # CPU indices of a CUDA tensor
            devices.add(dev)
        if len(devices) > 1:
            shapes = ", ".join(f"{tuple(t.shape)}@{t.device}" for t in tensors)
            raise MixedDeviceError(f"{func}: expected all tensors to be on the same device, got {shapes}")
        if devices:
            return devices.pop()
        if explicit is not None:
            return _normal(explicit)
        return _normal(first.device) if first is not None else torch.device("cpu")


def _unwrap(x):
    """The CPU storage of a fake-CUDA tensor (a :class:`Tagged`, or a parameter whose ``.data`` was set to one),
    else ``x``."""
    inner = getattr(x, "_cpu_storage", None) if isinstance(x, torch.Tensor) else None
    return inner if inner is not None else x


class _FakeCudaFunctions(torch.overrides.TorchFunctionMode):
    """What fails before any dispatch on a CPU-only build: ``torch.tensor(..., device="cuda")`` and friends (built on
    the CPU in C++: build on the CPU, then move), and a ``cuda`` device without an index in ``Tensor.to`` /
    ``Tensor.cuda`` (C++ asks the CUDA runtime for the current device: ``cuda:0`` is passed instead)."""

    BUILDERS = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor}

    def __init__(self, syncs: Counter):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.BUILDERS:
            dev = _as_device(kwargs.get("device"))
            if dev is not None and dev.type == "cuda":
                kwargs["device"] = "cpu"
                return func(*args, **kwargs).to(FAKE)
        elif func in HOST_READS and _unwrap(args[0]) is not args[0]:
            self.syncs["value read"] += 1
            return func(_unwrap(args[0]), *args[1:], **kwargs)
        elif getattr(func, "__self__", None) is DATA and func.__name__ == "__set__":
            target, value = args  # ``param.data = value`` (nn.Module.to): the parameter takes value's storage
            func(target, value)
            target._cpu_storage = _unwrap(value) if _unwrap(value) is not value else None
            return None
        elif func is torch.Tensor.__getitem__:
            return _getitem(*args)
        elif func is torch.Tensor.__setitem__:
            return _setitem(*args)
        elif func is torch.Tensor.new_tensor and _unwrap(args[0]) is not args[0] and kwargs.get("device") is None:
            return _unwrap(args[0]).new_tensor(*args[1:], **kwargs).to(args[0].device)
        elif func is torch.Tensor.cuda:
            return args[0].to(FAKE, non_blocking=kwargs.get("non_blocking", False))
        elif func is torch.device and args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return torch.device("cuda", args[0])  # a bare index names the current accelerator
        elif func is torch.Tensor.to:
            args, kwargs = tree_map(_indexed, (args, kwargs))
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
        # a Python binding that enters a CUDA device guard before dispatching (nonzero, ...): check, run on the CPU
        # storage, tag the results
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        target = _FakeCudaDispatch._target(func, args, kwargs, tensors)
        if func in DATA_DEPENDENT:
            self.syncs["data-dependent shape"] += 1
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda o: Tagged(o, target) if isinstance(o, torch.Tensor) else o, out)


def _index_tensors(index) -> list[torch.Tensor]:
    return [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)]


def _getitem(self: torch.Tensor, index):
    """``self[index]`` (C++ enters a CUDA device guard before any dispatch): index tensors on another accelerator
    than ``self`` raise, CPU index tensors are allowed (CUDA moves them)."""
    dev = _normal(self.device)
    for t in _index_tensors(index):
        if _normal(t.device) not in (dev, torch.device("cpu")):
            raise MixedDeviceError(f"indexing a {dev} tensor with a {t.device} index (CUDA raises: 'indices should "
                                   f"be either on cpu or on the same device as the indexed tensor')")
    out = _unwrap(self)[tree_map(_unwrap, index)]
    return Tagged(out, dev) if dev.type == "cuda" else out


def _setitem(self: torch.Tensor, index, value) -> None:
    """``self[index] = value``: basic indexing copies across devices (``copy_``); advanced indexing
    (``index_put_``) needs ``value`` on ``self``'s device unless it is a scalar."""
    _getitem(self, index)  # the index rule
    dev = _normal(self.device)
    advanced = bool(_index_tensors(index))
    if advanced and isinstance(value, torch.Tensor) and value.dim() > 0 and _normal(value.device) != dev:
        raise MixedDeviceError(f"index_put_ into a {dev} tensor with values on {value.device} (CUDA raises: "
                               f"'Expected all tensors to be on the same device')")
    if isinstance(value, torch.Tensor) and _normal(value.device) != dev and value.dim() > 0 and not advanced:
        value = value.to(dev)  # basic indexing: a cross-device copy_
    _unwrap(self)[tree_map(_unwrap, index)] = _unwrap(value)


def _on_cpu(x):
    """A ``cuda`` device argument as the CPU (where the op really runs); anything else unchanged."""
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x


def _indexed(x):
    """``cuda`` (a string, a device without an index, or a bare index) as ``cuda:0``; anything else unchanged."""
    if isinstance(x, str) and x.split(":")[0] == "cuda" or isinstance(x, torch.device) and x.type == "cuda":
        return FAKE
    if isinstance(x, int) and not isinstance(x, bool):  # Tensor.to(0): an accelerator index
        return FAKE
    return x


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[_FakeCudaDispatch]:
    """Inside: ``torch.cuda.is_available()`` is True (one bf16-capable device), ``device="cuda"`` tensors are
    :class:`Tagged` CPU tensors, and a mixed-device op raises :class:`MixedDeviceError`. Yields the dispatch mode
    (``.ops`` counts the ops it ran, ``.syncs`` what would block the host on a GPU, by kind). Autograd is off
    inside."""
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "fake CUDA (CPU storage)")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(
        name="fake CUDA", total_memory=16 << 30, is_integrated=False, major=9, minor=0))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    torch._C._ensureCUDADeviceGuardSet()  # a no-op CUDA device guard on a CPU-only build (as fake tensors do)
    mode = _FakeCudaDispatch()
    # no autograd: a gradient edge of a fake-CUDA parameter needs a CUDA device guard (an abort, not an error)
    with torch.no_grad(), _FakeCudaFunctions(mode.syncs), mode:
        yield mode


def devices_of(module: torch.nn.Module) -> set[str]:
    """The devices of a module's parameters and buffers (``{"cuda:0"}`` when everything moved)."""
    return {str(t.device) for t in list(module.parameters()) + list(module.buffers())}


class Patches:
    """monkeypatch's ``setattr`` for a script (the benchmarks run :func:`fake_cuda` outside pytest): undone by
    :meth:`close`."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
