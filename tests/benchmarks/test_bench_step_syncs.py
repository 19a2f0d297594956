"""benchmarks/bench_step_syncs.py counts syncs and ops outside the forward per batch step (issue 42)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_path_per_batch_step(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_step_syncs", ROOT / "benchmarks" / "bench_step_syncs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--paths", "plain", "--batch", "1", "2", "--max-tokens", "4",
                       "--out", str(tmp_path / "syncs")]) == 0
    rows = json.loads((tmp_path / "syncs.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["batch_steps"] == 4 and r["request_steps"] == 4 * r["batch"]  # block 4, one token per step
        assert r["total_syncs"] == sum(r["syncs"].values()) and r["ops_inside"] > 0 and r["ops_outside"] > 0
        assert r["syncs_per_step"] == round(r["total_syncs"] / 4, 2)
    assert (tmp_path / "syncs.md").read_text().count("| plain |") == 2
