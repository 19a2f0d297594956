"""benchmarks/gpu_check.py on this CPU, as on the GPU host it is written for: ``--device cpu --small`` (the same code
paths as the GPU run: the lane, the engine against the LLaDA reference loop with equal tokens) in a process where
unmask is not installed and none of its dependencies but torch, transformers and theirs can be imported; its
JSON's fields; and the reference loop's pieces."""
from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check as gc  # noqa: E402

# runs the script with an import hook that refuses what the GPU host lacks
BARE_HOST = """
import runpy, sys
BLOCKED = set({blocked!r})

class NotOnTheHost:
    \"\"\"A finder of sys.meta_path that finds nothing the host lacks (find_spec answers None, as there).\"\"\"
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in BLOCKED or (top == "unmask" and "unmask" not in sys.modules):  # unmask: not installed there
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [NotOnTheHost(f) for f in sys.meta_path]
sys.argv = [{script!r}, *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def _requirement_names(dist: str, extras: bool) -> set[str]:
    names = set()
    for r in md.distribution(dist).requires or []:
        if "extra ==" in r and not extras:
            continue
        names.add(re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower().replace("_", "-"))
    return names


def host_lacks() -> list[str]:
    """Import names of unmask's dependencies (and test extras) that are not torch, transformers or one of their
    own dependencies: what the GPU host does not have."""
    closure, todo = set(), ["torch", "transformers"]
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            todo += sorted(_requirement_names(name, extras=False))
        except md.PackageNotFoundError:
            pass
    lacking = _requirement_names("unmask", extras=True) - closure
    modules = {m for m, dists in md.packages_distributions().items()
               if any(d.lower().replace("_", "-") in lacking for d in dists)}
    return sorted(modules - {"_distutils_hack"})


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    blocked = host_lacks()
    assert {"llguidance", "fastapi", "accelerate", "pytest"} <= set(blocked)
    code = BARE_HOST.format(blocked=blocked, script=str(SCRIPT), args=["--device", "cpu", "--small", "--out",
                                                                       str(out)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, out


def test_the_small_cpu_run_passes_without_unmask_or_its_other_dependencies(small_run):
    proc, out = small_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["required"] == {"cuda_lane": True, "speed_equal_tokens": True,
                                                       "cuda_graphs": True}
    assert data["unmask_import"].startswith("source tree")
    env = data["environment"]
    for key in ("torch", "torch_cuda_build", "transformers", "driver_version", "sdpa_probe", "llguidance"):
        assert key in env
    assert env["llguidance"] is False and env["sdpa_probe"]["math"]["bool_mask"] == "ok"
    lane = data["cuda_lane"]["float32"]
    assert lane["summary"]["failed"] == 0
    skipped = {c["name"] for c in lane["checks"] if c["ok"] is None}
    assert skipped == {"constrained-plain", "constrained-threshold", "constrained-speculative",
                       "adapter-constrained"}  # llguidance is missing: skipped with a note, not failed
    assert all("llguidance" in c["note"] for c in lane["checks"] if c["ok"] is None)
    assert data["host_syncs"] == {"skipped": "sync debug mode is CUDA's"}
    graphs = data["cuda_graphs"]  # the static step uncaptured on a CPU: equality, and the option refused
    assert graphs["ok"] is True and graphs["refused_on_cpu"] is True and "engine" not in graphs
    assert [(r["rows"], r["mixed"]) for r in graphs["steps"]] == [(32, False), (32, True), (256, False), (256, True)]
    for row in graphs["steps"]:
        assert row["equal"] is True and row["bitwise"] is True and row["max_diff"] == 0.0  # a CPU: bit for bit
        assert row["stats"]["static_steps"] > 3 and not row["stats"].get("eager_steps")
        assert row["eager_ms"] > 0 and row["graph_ms"] > 0
    speed = data["speed"]
    assert speed["settings"]["require_equal"] is True and speed["ok"] is True
    assert [r["batch"] for r in speed["rows"]] == list(gc.SMALL_RUN["batches"])
    for row in speed["rows"]:
        assert row["engine_cache_none"]["equal"] is True and row["engine_cache_none"]["match_reference"] == 1.0
        assert row["reference"]["tokens_per_s"] > 0 and 0 <= row["engine_cache_dual"]["match_reference"] <= 1
    assert "required checks" in proc.stdout


def test_the_graphs_alone_run_without_the_lane_and_the_speed_sections(tmp_path, monkeypatch):
    """``--skip-lane --skip-speed``: the environment, host syncs and the cuda graphs section only."""
    monkeypatch.setattr(gc, "prepare", lambda args: "test")
    monkeypatch.setattr(gc, "GRAPH_ROWS", (32,))
    out = tmp_path / "graphs.json"
    assert gc.main(["--device", "cpu", "--small", "--skip-lane", "--skip-speed", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["required"] == {"cuda_graphs": True} and "speed" not in data and "cuda_lane" not in data
    assert [r["rows"] for r in data["cuda_graphs"]["steps"]] == [32, 32]


def test_check_env_only(tmp_path):
    out = tmp_path / "env.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check-env-only", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"command", "unmask_import", "settings", "environment", "seconds"}


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--device cuda" in proc.stderr and "--device cpu --small" in proc.stderr


def test_transfer_counts_split_a_block_over_its_steps():
    counts = gc.transfer_counts(torch.tensor([8, 5, 0]), 4)
    assert counts.tolist() == [[2, 2, 2, 2], [2, 1, 1, 1], [0, 0, 0, 0]]


def test_the_reference_loop_reveals_every_position_once_and_never_the_mask():
    model = gc.build_llada(gc.SMALL, "cpu", torch.float32)
    prompts = torch.randint(0, 600, (2, 8), generator=torch.Generator().manual_seed(0))
    out = gc.reference_generate(model.model, prompts, 8, 4, 8, gc.SMALL["mask_id"])
    assert out.shape == (2, 8) and not (out == gc.SMALL["mask_id"]).any()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32 and model.max_context == 4096
    assert model.model.lm_head.weight[gc.SMALL["mask_id"]].abs().sum() == 0


def test_the_llada_8b_shape_is_llada_8bs():
    assert gc.LLADA_8B["vocab"] == 126464 and gc.LLADA_8B["mask_id"] == 126336
    assert (gc.LLADA_8B["d_model"], gc.LLADA_8B["n_layers"], gc.LLADA_8B["n_heads"],
            gc.LLADA_8B["mlp_hidden_size"]) == (4096, 32, 32, 12288)
    assert gc.FULL_RUN == dict(batches=(1, 8, 32), prompt=256, new_tokens=64, block=32)


def test_a_model_built_in_memory_is_served_as_it_is():
    """``LoadedModel.from_module``: device and dtype from the parameters; mixed ones are refused."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import LoadedModel

    model = gc.build_llada(gc.SMALL, "cpu", torch.float32)
    out = LLM(model).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    model.model.lm_head.to(torch.float64)
    with pytest.raises(ValueError, match="one device in one dtype"):
        LoadedModel.from_module(model.model, model.tokenizer, model.dllm)


def test_the_gpu_runs_own_branch_on_a_shrunken_shape(tmp_path, monkeypatch):
    """Without --small: the small float32 model's equal-token check, then the big shape in bfloat16 with the match
    reported, not required (here on the CPU, the 8B shape shrunk, the lane left out)."""
    monkeypatch.setattr(gc, "prepare", lambda args: "test")
    monkeypatch.setattr(gc, "LLADA_8B", dict(gc.SMALL, d_model=128, n_layers=3, mlp_hidden_size=256))
    monkeypatch.setattr(gc, "FULL_RUN", dict(batches=(1, 3), prompt=24, new_tokens=16, block=8))
    out = tmp_path / "full.json"
    assert gc.main(["--device", "cpu", "--skip-lane", "--skip-graphs", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["required"] == {"reference_equality": True} and "cuda_lane" not in data
    assert data["reference_equality"]["settings"]["dtype"] == "float32"
    speed = data["speed"]
    assert speed["settings"]["dtype"] == "bfloat16" and speed["settings"]["require_equal"] is False
    assert speed["ok"] is None and speed["model"]["d_model"] == 128
    for row in speed["rows"]:
        assert "equal" not in row["engine_cache_none"] and 0 <= row["engine_cache_none"]["match_reference"] <= 1
