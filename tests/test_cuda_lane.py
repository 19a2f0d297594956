"""The ``cuda`` lane (tests/cuda_lane.py's checks) on a real GPU, in float32 and bfloat16, against a CPU float32
reference; without a GPU those tests skip, also under CI=true (the never-skip rule's exemption: tests/serving.py).
The CPU self-check below runs the same check functions on the CPU in every run, and the CPU pin of
tests/conftest.py is checked here too."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import cuda_lane as cl
import decoding_paths as dp
import serving

CHECKPOINTS = ("causal", "bidirectional", "block_causal", "adapter", "llada2")
CASES = ([("forward", name) for name in CHECKPOINTS] + [("path", p.name) for p in dp.PATHS]
         + [("contract", name) for name in cl.CONTRACTS])
PATHS = {p.name: p for p in dp.PATHS}


def run_check(lane, kind, name, device, dtype) -> cl.Check:
    if kind == "forward":
        return cl.check_forward(lane, name, device, dtype)
    if kind == "path":
        return cl.check_path(lane, PATHS[name], device, dtype)
    return cl.run_contracts(lane, device, dtype, [name])[0]


@pytest.fixture(scope="module")
def gpu_lane():
    serving.require_cuda()
    lane = cl.Lane()
    yield lane
    lane.close()


@pytest.fixture(scope="module")
def cpu_lane():
    lane = cl.Lane()
    yield lane
    lane.close()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=cl.dtype_name)
@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_on_cuda(gpu_lane, kind, name, dtype):
    check = run_check(gpu_lane, kind, name, "cuda", dtype)
    if check.ok is None:
        pytest.skip(check.note)
    assert check.ok, check.as_dict()


# ------------------------------------------------------------------ the CPU self-check (every run)
def test_the_lane_passes_on_the_cpu_in_float32(cpu_lane):
    """Every forward, path and contract of the lane, CPU float32 against CPU float32: the check functions run,
    and the contracts hold exactly on the CPU (their reference device)."""
    checks = cl.run_lane("cpu", torch.float32, cpu_lane)
    assert len(checks) == len(CASES)
    assert cl.summary(checks)["failures"] == []
    skipped = {c.name for c in checks if c.ok is None}
    assert skipped <= ({p.name for p in dp.PATHS if p.constrained} if not cl.has_llguidance() else set())
    assert all(c.agreement == 1.0 for c in checks if c.ok), [c.as_dict() for c in checks if c.agreement != 1.0]
    reuse = next(c for c in checks if c.name == "prefix-reuse-equals-fresh-prefill")
    assert reuse.note.split()[0] != "0"  # the prefix cache was read


def test_the_half_precision_rule_on_a_cpu_bf16_forward(cpu_lane):
    check = cl.check_forward(cpu_lane, "causal", "cpu", torch.bfloat16)
    assert check.ok, check.as_dict()
    assert cl.HALF_MIN_ARGMAX <= check.agreement < 1.0 or check.agreement == 1.0


def test_a_wrong_forward_fails_the_lane(cpu_lane):
    """A model whose first layer differs (as a device bug would make it) fails the forward and the paths, naming
    the first differing position ("cpu:0" is a device string of its own for the lane's model cache)."""
    good = cpu_lane.model("causal", "cpu", torch.float32)
    bad = copy.deepcopy(good)
    with torch.no_grad():
        q = bad.model.model.layers[0].self_attn.q_proj.weight
        q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(0)))
    cpu_lane._models[("causal", "cpu:0", torch.float32)] = bad
    forward = cl.check_forward(cpu_lane, "causal", "cpu:0", torch.float32)
    assert forward.ok is False and forward.first_difference is not None, forward.as_dict()
    path = cl.check_path(cpu_lane, PATHS["quota"], "cpu:0", torch.float32)
    assert path.ok is False and path.agreement < 1.0 and path.first_difference is not None, path.as_dict()


def test_a_crash_is_reported_not_raised(cpu_lane):
    check = cl.check_path(cpu_lane, PATHS["quota"], "cpu", "no-such-dtype")  # load_model refuses the dtype
    assert check.ok is False and check.note.startswith("ValueError: dtype"), check.as_dict()


def test_judge_rules():
    assert cl.judge(torch.float32, [[1, 2, 3]], [[1, 2, 3]]) == (True, 1.0, None)
    assert cl.judge(torch.float32, [[1, 2, 3]], [[1, 2, 4]]) == (False, 2 / 3, [0, 2])
    assert cl.judge(torch.float32, [[1, 2]], [[1, 2, 3]])[0] is False  # a missing position differs
    ok, frac, first = cl.judge(torch.bfloat16, [[1, 9, 9, 9, 9, 9, 9, 9, 9, 9]], [[1] * 10])
    assert ok and frac == 0.1 and first == [0, 1]
    assert cl.judge(torch.bfloat16, [[9] * 10], [[1] * 10])[0] is False
    assert cl.requirement(torch.float32) == "equal tokens"
    assert cl.judge(torch.bfloat16, [[1, 2, 3]], [[1, 2, 4]], exact=True)[0] is False  # EXACT_IN_EVERY_DTYPE


def test_the_exact_in_every_dtype_contract_holds_in_bf16_on_the_cpu(cpu_lane):
    (check,) = cl.run_contracts(cpu_lane, "cpu", torch.bfloat16, sorted(cl.EXACT_IN_EVERY_DTYPE))
    assert check.ok and check.agreement == 1.0 and "every dtype" in check.requirement, check.as_dict()


# ------------------------------------------------------------------ the CPU pin (tests/conftest.py)
def test_auto_resolves_to_the_cpu_in_tests_even_with_a_gpu(monkeypatch):
    from unmask.engine.model import load_model, resolve_device, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert resolve_device("auto") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    assert resolve_dtype("auto", resolve_device("auto")) == torch.float32
    assert inspect.signature(load_model).parameters["device"].default == "auto"  # load_model(path): pinned too


def test_an_explicit_device_is_not_pinned(monkeypatch):
    from unmask.engine.model import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda")
