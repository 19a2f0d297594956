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
