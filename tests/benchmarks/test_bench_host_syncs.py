"""benchmarks/bench_host_syncs.py counts host syncs per request-step under fake CUDA (tests/device_tags.py)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_path_is_counted_by_kind(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_host_syncs", ROOT / "benchmarks" / "bench_host_syncs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--paths", "quota", "--batch", "1", "--out", str(tmp_path / "syncs")]) == 0
    (row,) = json.loads((tmp_path / "syncs.json").read_text())["rows"]
    assert row["path"] == "quota" and row["request_steps"] == 12  # one token per step, 12 tokens
    assert row["total"] == sum(row["syncs"].values()) > 0 and row["syncs"]["device-to-host"] > 0
    assert (tmp_path / "syncs.md").read_text().count("| quota | 1 |") == 1
