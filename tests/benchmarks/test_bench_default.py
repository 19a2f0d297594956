"""Unit tests of benchmarks/bench_default.py's judging, bench_common's shared pieces and build_llama_bench.sh's
idempotent path (no model, no server, no network)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_common as bc  # noqa: E402
import bench_default as bd  # noqa: E402


def mode(tps, tpf=1.0, identical=1.0, acc=0.5):
    return {"tokens_per_s": tps, "tpf": tpf, "identical_to_parent": identical, "accuracy": acc}


def summary(**over):
    s = {"hf": mode(20.0), "block1-fp16": mode(8.0), "block1-int8": mode(12.0),
         "spec": mode(11.2, tpf=1.7), "diffusion-t0.5": mode(25.0, tpf=2.1, identical=0.0, acc=0.4),
         "tg-fp16": mode(10.0, identical=None, acc=None), "tg-int8": mode(12.0, identical=None, acc=None)}
    s.update(over)
    return s


def test_judge_ratios_and_targets():
    s = summary()
    bd.judge(s, "fp16", llama_tps=18.0)
    assert s["block1-int8"]["x_block1"] == pytest.approx(1.5)   # end to end against end to end
    assert s["tg-int8"]["x_block1"] == pytest.approx(1.2)       # tg against tg
    assert s["hf"]["x_llama_cpp"] == pytest.approx(20 / 18)
    assert s["tg-fp16"]["pass"] is True              # tg 10/18 = 0.56 >= 0.5 (end to end 8/18 is not judged)
    assert "target" not in s["block1-fp16"]
    assert s["spec"]["pass"] is True                 # 1.4x the end-to-end block 1, identical, TPF 1.7
    assert s["diffusion-t0.5"]["accuracy_vs_parent"] == pytest.approx(0.8)
    assert s["diffusion-t0.5"]["pass"] is True
    assert "target" not in s["block1-int8"] and "target" not in s["hf"] and "target" not in s["tg-int8"]


def test_judge_failures():
    s = summary(spec=mode(14.0, tpf=1.7, identical=35 / 36), **{"diffusion-t0.9": mode(9.0, tpf=1.9, acc=0.5),
                                                               "diffusion-t0.3": mode(30.0, tpf=3.0, acc=0.3)})
    bd.judge(s, "fp16", llama_tps=21.0)
    assert s["tg-fp16"]["pass"] is False             # 10/21 < 0.5
    assert s["spec"]["pass"] is False                # one answer differs from the parent's
    assert s["diffusion-t0.9"]["pass"] is False      # TPF < 2
    assert s["diffusion-t0.3"]["pass"] is False      # 0.6x the parent's accuracy
    slow = summary(spec=mode(9.6, tpf=1.7))
    bd.judge(slow, "fp16", None)
    assert slow["spec"]["pass"] is False             # 1.2x < 1.3x
    assert slow["tg-fp16"]["pass"] is None and slow["tg-fp16"]["x_llama_cpp"] is None


def test_judge_reference_is_the_served_format_and_zero_parent_accuracy_fails():
    s = summary(hf=mode(20.0, acc=0.0))
    bd.judge(s, "int8", llama_tps=18.0)
    assert s["block1-int8"]["x_block1"] == 1.0 and "target" in s["tg-int8"] and "target" not in s["tg-fp16"]
    assert math.isnan(s["diffusion-t0.5"]["accuracy_vs_parent"]) and s["diffusion-t0.5"]["pass"] is False


@pytest.mark.parametrize("extra,peak,ok_extra,ok_peak", [(49.0, 1439.0, True, True), (51.0, 1440.0, False, False)])
def test_judge_memory(extra, peak, ok_extra, ok_peak):
    parent = {"rss_after_mb": 1000.0, "peak_rss_mb": 1100.0}
    default = {"rss_after_mb": 1000.0 + extra, "peak_rss_mb": peak}
    m = bd.judge_memory(parent, default)
    assert m["adapter_extra_rss_mb"] == pytest.approx(extra)
    assert m["adapter_extra_peak_mb"] == pytest.approx(peak - 1100.0)
    assert (m["adapter_extra_pass"], m["default_peak_pass"]) == (ok_extra, ok_peak)


def test_accuracy_counts_only_checkable_prompts():
    prompts = [{"answer": "180"}, {"answer": None}, {"answer": "Oslo"}]
    outs = [SimpleNamespace(text="180"), SimpleNamespace(text="anything"), SimpleNamespace(text="Bergen")]
    assert bd.accuracy(outs, prompts) == 0.5
    assert math.isnan(bd.accuracy(outs[1:2], prompts[1:2]))


def test_grid_prompts_in_grid_order():
    ids = json.loads((BENCH / "data" / "eval_grid_ids.json").read_text())["ids"]
    rows = bc.grid_prompts()
    assert [r["id"] for r in rows] == ids and len(rows) == 60
    assert [r["id"] for r in bc.grid_prompts(5)] == ids[:5]
    assert all(r["prompt"] for r in rows) and any(r.get("answer") is not None for r in rows)


def test_proc_status_kib():
    rss, hwm = bc.proc_status_kib(os.getpid()), bc.proc_status_kib(os.getpid(), "VmHWM")
    assert 0 < rss <= hwm
    with pytest.raises(RuntimeError, match="no VmNope"):
        bc.proc_status_kib(os.getpid(), "VmNope")


def test_build_llama_bench_is_idempotent(tmp_path):
    binary = tmp_path / "bin" / "llama-bench"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    # PYTHON=false: a second run must not download or build anything
    r = subprocess.run(["bash", str(BENCH / "build_llama_bench.sh"), str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": "false"}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(binary)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_engine_tg_counts_only_the_decoding_steps():
    """The tg row (llama-bench's quantity): n tokens per prompt, and the time of the 1-token run (the prompt's
    forward) subtracted: a model whose every forward sleeps 10 ms gives ~n * 10 ms per prompt, not n + 1."""
    import time

    import tiny
    from unmask.engine import LLM, SamplingParams

    lm = tiny.loaded()
    llm = LLM(lm, max_batch_size=1)
    forward = lm.hidden_states

    def slow(*a, **k):
        time.sleep(0.01)
        return forward(*a, **k)

    lm.hidden_states = slow
    prompts = [{"prompt": "Hello world"}, {"prompt": "the quick brown"}]
    r = bd.engine_tg(llm, prompts, 8, lambda k: SamplingParams(max_tokens=k, temperature=0, block_size=1,
                                                                 ignore_eos=True))
    assert r["tokens"] == 16
    assert 0.16 <= r["seconds"] < 0.16 + 0.3     # 16 decoding forwards of >= 10 ms (the 2 prompt forwards not)


def test_parse_spec_configs():
    assert bd.parse_spec_configs("2:0, 3:1,") == [(2, 0), (3, 1)] and bd.parse_spec_configs("") == []
    for bad in ("2", "2:x", "1:0", "3:3", "4:-1"):
        with pytest.raises(ValueError, match="--spec-configs"):
            bd.parse_spec_configs(bad)
