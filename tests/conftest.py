import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Tiny models: one thread is faster than two (no thread hand-off per op) and avoids oversubscription when the
# machine is shared; real-model (slow) tests may raise it themselves.
torch.set_num_threads(1)

import pytest  # noqa: E402

# Every test runs on the CPU, in float32 (the dtype `auto` gives there), whatever GPU the machine has, pinned here
# at import so that module-level models and fixtures of any scope are pinned too: `auto` (and None) devices
# resolve to the CPU through unmask.engine.model.auto_device, the one place that decides `auto`, and child
# processes (servers, CLI runs) see no GPU. An explicit device="cuda" is untouched (the fake-CUDA harness passes
# it). Tests marked `cuda` (the GPU lane, tests/test_cuda_lane.py) are exempt: `cuda_lane_unpinned` below.
import unmask.engine.model as engine_model  # noqa: E402

AUTO_DEVICE = engine_model.auto_device  # the unpinned rule
# asked once, before CUDA_VISIBLE_DEVICES hides the GPUs: the CUDA runtime reads that variable at its first call,
# which this is, so this process (the cuda lane) keeps the GPU and only child processes lose it
HAS_CUDA = torch.cuda.is_available()
VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
engine_model.auto_device = lambda: torch.device("cpu")
if HAS_CUDA:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True)
def cuda_lane_unpinned(request, monkeypatch):
    """Tests marked ``cuda`` get the unpinned ``auto`` and the GPUs in child processes back (the CPU pin above
    holds for every other test)."""
    if request.node.get_closest_marker("cuda") is not None:
        monkeypatch.setattr(engine_model, "auto_device", AUTO_DEVICE)
        if VISIBLE_DEVICES is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE_DEVICES)
    yield


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread: on a shared, loaded 2-core CPU more threads spin and are
    10-50x slower (measured: 12 s vs 0.25 s for 16 steps). Every test module starts at one thread; the value is
    restored after the module (a slow test may raise it itself)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``system`` (tmux, Chromium, docker, Prometheus, nginx, multi-process) run only when the mark
    expression names them (``pytest -m system``, as .ci/run does after the README's test command)."""
    if "system" in (config.getoption("markexpr") or ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("system") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
