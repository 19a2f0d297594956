"""Unit tests of benchmarks/bench_gguf_vs_llama.py's llama.cpp runner and table (a stand-in binary, no model)."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_gguf_vs_llama as bg  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc/PID/stat (Linux)")

# burns CPU seconds before its first progress line (its load) and after it (its loop), then prints the timing line
STAND_IN = """#!{python}
import os, signal, sys, time
def burn(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
burn({load})
sys.stderr.write("diffusion step: 0/6 [   ] 0%\\r"); sys.stderr.flush()
burn({loop})
if {die}:
    os.kill(os.getpid(), signal.SIGILL)
print("total time: 1234.5ms, time per step: 205.7ms, sampling time per step: 1.5ms", file=sys.stderr)
"""


def stand_in(tmp_path, load=0.0, loop=0.0, die=False) -> Path:
    path = tmp_path / "llama-diffusion-cli"
    path.write_text(STAND_IN.format(python=sys.executable, load=load, loop=loop, die=die))
    path.chmod(0o755)
    return path


def test_llama_cpus_loading_is_not_counted_in_its_loop(tmp_path):
    r = bg.run_llama(stand_in(tmp_path, load=0.2, loop=0.1), tmp_path / "m.gguf", steps=32, threads=2)
    assert r["seconds"] == pytest.approx(1.2345) and "--poll" not in r["command"]
    assert r["forwards"] == 34  # 8 steps x 4 blocks + 2 empty blocks past the canvas
    assert r["cpu_seconds_with_load"] - r["cpu_seconds"] >= 0.18  # the load's 0.2 s left out (ticks of 10 ms)
    assert 0.08 <= r["cpu_seconds"] <= r["cpu_seconds_with_load"] - 0.18


def test_passive_waiting_asks_llama_not_to_poll(tmp_path):
    r = bg.run_llama(stand_in(tmp_path), tmp_path / "m.gguf", steps=32, threads=2, passive=True)
    assert r["command"].endswith("--poll 0")


def test_a_crashing_llama_is_recorded_not_raised(tmp_path):
    r = bg.run_llama(stand_in(tmp_path, die=True), tmp_path / "m.gguf", steps=32, threads=2)
    assert r["failed"] == "SIGILL" and math.isnan(r["seconds"]) and r["forwards"] == 0


def test_a_llama_that_exits_before_its_loop_is_recorded(tmp_path):
    path = tmp_path / "llama-diffusion-cli"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('error: no model')\nsys.exit(1)\n")
    path.chmod(0o755)
    r = bg.run_llama(path, tmp_path / "m.gguf", steps=32, threads=2)
    assert r["failed"] == "exit 1" and "no model" in r["tail"]


def test_each_unmask_configuration_is_judged_against_its_caches_target():
    runs = {"llama.cpp": [{"seconds": 10.0, "cpu_seconds": 20.0, "forwards": 34}]}
    speed = {"none": 2.0, "dual": 3.0, "none bf16": 1.0, "dual bf16": 5.0}
    for c in speed:
        runs[c] = [{"seconds": 10.0 / speed[c], "cpu_seconds": 20.0 / speed[c], "forwards": 32}]
    res = {"runs": runs, "median_seconds": {k: v[0]["seconds"] for k, v in runs.items()},
           "median_cpu_seconds": {k: v[0]["cpu_seconds"] for k, v in runs.items()}, "speedup": speed,
           "speedup_cpu_seconds": speed, "speedup_per_forward": speed, "load_range": [1.0, 2.0]}
    rows = bg.table_rows("q8_0-steps128", res)
    verdicts = {row[2]: (row[0], row[1], row[12], row[13]) for row in rows}
    assert verdicts == {"none": ("Q8_0", 128, 1.5, "pass"), "dual": ("Q8_0", 128, 4.0, "MISS"),
                        "none bf16": ("Q8_0", 128, 1.5, "MISS"), "dual bf16": ("Q8_0", 128, 4.0, "pass")}
    passive = {row[2]: (row[1], row[12]) for row in bg.table_rows("f16-steps32-passive", res)}
    assert passive["dual bf16 (passive)"] == (32, 4.0) and len(passive) == 4


def test_the_no_amx_build_is_preferred_when_present(tmp_path, monkeypatch):
    monkeypatch.setattr(bg, "LLAMA_DIR", tmp_path)
    (tmp_path / "bin").mkdir()
    assert bg.default_binary().name == "llama-diffusion-cli"
    (tmp_path / "bin" / "llama-diffusion-cli-noamx").write_text("")
    assert bg.default_binary().name == "llama-diffusion-cli-noamx"
    assert os.path.dirname(bg.default_binary()) == str(tmp_path / "bin")
