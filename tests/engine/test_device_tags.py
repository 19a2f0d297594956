"""One device for every tensor (docs/design.md, "Devices"): every decoding path of ``tests/decoding_paths.py`` runs
on fake CUDA (``tests/device_tags.py``: CPU storage, a ``cuda`` tag, CUDA's mixed-device rule) from
``load_model(..., device="cuda")`` to the last token, and gives the tokens of a CPU run.

Before the fixes these failed: the mask-row adapter's weights stayed on the CPU after the model moved (every request
of the default model), and a constrained plain-diffusion step built its forced tokens' probabilities on the CPU.
"""
from __future__ import annotations

import pytest
import torch

import decoding_paths as dp
from device_tags import MixedDeviceError, Tagged, devices_of, fake_cuda
from unmask.engine import LLM
from unmask.engine.model import load_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("device_paths"))


@pytest.fixture(scope="module")
def cpu_tokens(checkpoints):
    """Each path's tokens on the CPU, float32, native weights (the reference)."""
    llms = {name: LLM(load_model(d, device="cpu", dtype="float32", weights="native")) for name, d in checkpoints.items()}
    return {p.name: dp.run_path(llms[p.checkpoint], p) for p in dp.PATHS}


def test_the_harness_raises_where_cuda_raises_and_allows_what_cuda_allows(monkeypatch):
    with fake_cuda(monkeypatch):
        a = torch.arange(4.0, device="cuda")
        assert isinstance(a, Tagged) and a.device.type == "cuda"
        for bad in (lambda: a + torch.ones(4), lambda: torch.where(a > 1, a, torch.zeros(4)),
                    lambda: torch.cat([a, torch.ones(2)]), lambda: torch.ones(4)[torch.tensor([1], device="cuda")],
                    lambda: torch.rand(2, generator=torch.Generator().manual_seed(0), device="cuda"),
                    lambda: torch.nn.Linear(4, 2)(a)):
            with pytest.raises(MixedDeviceError):
                bad()
        assert (a + torch.tensor(2.0)).device.type == "cuda"  # a CPU scalar joins
        assert a[torch.tensor([0, 2])].tolist() == [0.0, 2.0]  # CPU indices of a CUDA tensor
        a[torch.tensor([1])] = 5.0
        a[1:3] = torch.tensor([7.0, 8.0])  # basic indexing copies across devices
        b = torch.zeros(2, device="cuda").copy_(torch.tensor([1.0, 2.0]), non_blocking=True)  # copy_ too
        assert b.device.type == "cuda" and b.cpu().tolist() == [1.0, 2.0]
        assert a.cpu().tolist() == [0.0, 7.0, 8.0, 3.0] and type(a.cpu()) is torch.Tensor
        m = torch.nn.Linear(4, 2).to("cuda")
        assert devices_of(m) == {"cuda:0"} and m(a).device.type == "cuda"
        with torch.inference_mode():  # a view of a parameter in inference mode, as on a device (engine/moe.py)
            assert (a[None, :] @ m.weight.t()).shape == (1, 2) and not m.weight.t().is_inference()


@pytest.mark.parametrize("path", dp.PATHS, ids=lambda p: p.name)
def test_every_path_runs_on_one_device_and_gives_the_cpu_tokens(path, checkpoints, cpu_tokens, monkeypatch):
    with fake_cuda(monkeypatch):
        model = load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32")
        assert model.device.type == "cuda" and devices_of(model.model) == {"cuda:0"}
        tokens = dp.run_path(LLM(model), path)
    assert tokens == cpu_tokens[path.name]


def test_a_device_map_is_decided_before_any_weight_moves_to_the_device(checkpoints, monkeypatch):
    """``device="cuda", device_map=...``: the family loads on the CPU and accelerate dispatches from there; before,
    the whole model moved to the GPU first, so a model larger than the GPU failed before any offloading."""
    from unmask.engine import checkpoint_check, placement

    seen = {}
    real_load, real_place = checkpoint_check.load_checked, placement.place_model

    def load_spy(family, path, config, device, dtype, **kw):
        seen["load"] = torch.device(device)
        return real_load(family, path, config, device, dtype, **kw)

    def place_spy(loaded, device_map, max_memory=None, offload_folder=None, device=None):
        seen["place"] = (devices_of(loaded.model), device)
        loaded.device = torch.device(device)  # the dispatch itself is accelerate's (tests/engine/test_device_map.py)
        return {"": str(device)}

    monkeypatch.setattr(checkpoint_check, "load_checked", load_spy)
    monkeypatch.setattr(placement, "place_model", place_spy)
    with fake_cuda(monkeypatch):
        model = load_model(checkpoints["causal"], device="cuda", dtype="float32", device_map="auto")
    assert seen["load"].type == "cpu" and seen["place"][0] == {"cpu"} and seen["place"][1].type == "cuda"
    assert model.device.type == "cuda"


def test_a_strategy_places_modules_only_on_the_requested_device(monkeypatch):
    """``device_map="auto"`` with ``device="cpu"`` on a GPU machine: accelerate would fill the GPUs first; the map is
    restricted to the requested device, the CPU and disk."""
    from unmask.engine.placement import _memory_on

    mem = {0: 1 << 30, 1: 1 << 30, "cpu": 1 << 31, "disk": 1 << 40}
    assert _memory_on(torch.device("cpu"), dict(mem)) == {"cpu": 1 << 31, "disk": 1 << 40}
    assert _memory_on(torch.device("cuda", 1), dict(mem)) == {1: 1 << 30, "cpu": 1 << 31, "disk": 1 << 40}


def test_the_first_forward_check_fails_at_start_for_a_model_split_across_devices(checkpoints, monkeypatch):
    """``unmask serve`` forwards once before it listens (``engine/self_check.py``): the adapter left on the CPU
    beside a CUDA model (the default model's crash) is one error at start, not every request's."""
    from unmask.engine import SelfCheckError, check_first_forward, mask_adapter

    with fake_cuda(monkeypatch):
        check_first_forward(load_model(checkpoints["adapter"], device="cuda", dtype="float32"))
        monkeypatch.setattr(mask_adapter, "execution_device", lambda module: torch.device("cpu"))
        split = load_model(checkpoints["adapter"], device="cuda", dtype="float32")
        with pytest.raises(SelfCheckError, match=r"first forward on cuda \(float32, weights native\) failed: "
                                                 r"MixedDeviceError"):
            check_first_forward(split)
