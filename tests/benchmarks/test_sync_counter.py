"""tests/sync_counter.py counts what blocks the host on a GPU, once each, and nothing else (issue 42)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_tags import fake_cuda  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402


def test_item_counted_once():
    x = torch.arange(4.0)
    with SyncCounter("cpu") as c:
        x.sum().item()
    assert dict(c.syncs) == {"host read": 1}


@pytest.mark.parametrize("read", [lambda t: t.tolist(), lambda t: bool(t[0] > 0), lambda t: int(t[1]),
                                  lambda t: float(t[2]), lambda t: t.numpy(), lambda t: t.cpu()])
def test_each_python_read_counted_once(read):
    x = torch.arange(1, 5)
    with SyncCounter("cpu") as c:
        read(x)
    assert c.total == 1 and set(c.syncs) == {"host read"}


def test_boolean_mask_index_and_data_dependent_ops_counted():
    x = torch.arange(6.0)
    with SyncCounter("cpu") as c:
        x[x > 2]
    assert dict(c.syncs) == {"boolean-mask index": 1}
    with SyncCounter("cpu") as c:
        x[x > 2] = 0.0
        torch.nonzero(x)
        x.masked_select(x > 0)
        torch.equal(x, x)
    assert dict(c.syncs) == {"boolean-mask index": 1, "data-dependent shape": 2, "value read": 1}


def test_pure_device_ops_not_counted_and_ops_counted():
    x = torch.randn(4, 8)
    with SyncCounter("cpu") as c:
        y = torch.softmax(x, -1).argmax(-1)
        x[torch.tensor([0, 2])] = 1.0  # an integer index: no sync
        torch.where(x > 0, x, 0.0).topk(2, dim=-1)
        y.scatter(0, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    assert c.total == 0 and c.ops_outside > 5 and c.ops_inside == 0


def test_forward_methods_and_steps_are_separated():
    class Model:
        def forward(self, x):
            return (x * 2 + 1).relu()

        def step(self, x):
            y = self.forward(x)
            return y.sum().item()

    with SyncCounter("cpu") as c, c.forward_methods(Model, ("forward",)), c.step_method(Model, "step"):
        m = Model()
        m.step(torch.ones(3))
        m.step(torch.ones(3))
    assert c.ops_inside == 6 and len(c.steps) == 2
    assert all(s["syncs"] == {"host read": 1} and s["ops_outside"] == 2 for s in c.steps)  # sum, _local_scalar_dense
    assert Model.__dict__["forward"].__name__ == "forward" and not hasattr(Model.forward, "__wrapped__")


def test_under_fake_cuda_only_device_tensors_count(monkeypatch):
    with fake_cuda(monkeypatch):
        host = torch.arange(4)
        dev = torch.arange(4, device="cuda")
        with SyncCounter("cuda") as c:
            host.tolist()
            host[host > 1]
            dev.tolist()
            dev[dev > 1]
            dev.cpu()
            torch.ones(3).to("cuda")
            (dev + 1).argmax()
    assert dict(c.syncs) == {"host read": 2, "boolean-mask index": 1, "host-to-device": 1}


def test_host_to_device_builds_counted_under_inference_mode(monkeypatch):
    with fake_cuda(monkeypatch):
        with SyncCounter("cuda") as c, torch.inference_mode():
            torch.tensor([1, 2], device="cuda")
            torch.ones(2).to("cuda")
            torch.ones(2).to("cuda", non_blocking=True)
            torch.ones(2).to("cuda", torch.float32, True)  # non_blocking, positional
            torch.ones(2).to(torch.float64)
    assert dict(c.syncs) == {"host-to-device": 2}
