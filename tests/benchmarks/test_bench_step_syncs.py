"""benchmarks/bench_step_syncs.py counts syncs and ops outside the forward per batch step (issue 42)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_per_batch_step_engine_and_reference(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_step_syncs", ROOT / "benchmarks" / "bench_step_syncs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--paths", "plain,reference", "--batch", "1", "2", "--max-tokens", "4",
                       "--out", str(tmp_path / "syncs")]) == 0
    rows = json.loads((tmp_path / "syncs.json").read_text())["rows"]
    assert [(r["path"], r["batch"]) for r in rows] == [("plain", 1), ("plain", 2), ("reference", 1), ("reference", 2)]
    for r in rows:
        assert r["batch_steps"] == 4 and r["request_steps"] == 4 * r["batch"]  # block 4, one token per step
        assert r["total_syncs"] == sum(r["syncs"].values()) and r["ops_inside"] > 0 and r["ops_outside"] > 0
        assert r["syncs_per_step"] == round(r["total_syncs"] / 4, 2)
    ref1, ref2 = rows[2], rows[3]
    # the vectorized loop: one host read and one host-to-device copy per step (+ setup), whatever the batch
    assert ref1["syncs"] == ref2["syncs"] and ref1["syncs"]["host read"] == 5
    assert abs(ref1["ops_outside"] - ref2["ops_outside"]) <= 0.05 * ref1["ops_outside"]  # (a contiguous() is a
    # no-op at batch 1)
    assert (tmp_path / "syncs.md").read_text().count("| plain |") == 2
