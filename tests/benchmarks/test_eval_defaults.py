"""``unmask eval`` evaluates, by default, the model ``unmask serve`` serves: the conversion plus the shipped
mask-row adapter (found by a new user: the defaults were the parent and the untrained conversion only)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import eval_quality  # noqa: E402


def test_the_served_default_is_among_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("UNMASK_HOME", str(tmp_path))
    monkeypatch.delenv("UNMASK_DEFAULT_ADAPTER", raising=False)
    from unmask.default_adapter import available

    models = dict(eval_quality.default_models())
    assert models["untrained"] == str(tmp_path / "models" / "smollm2-135m-a2d")
    assert available()  # the repository ships the adapter
    assert models["default-adapter"] == str(tmp_path / "models" / "smollm2-135m-a2d-mask-adapter")
    assert set(eval_quality.PREPARED_ON_FIRST_USE) >= {"untrained", "default-adapter"}


def test_not_with_the_adapter_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("UNMASK_HOME", str(tmp_path))
    monkeypatch.setenv("UNMASK_DEFAULT_ADAPTER", "0")
    assert "default-adapter" not in dict(eval_quality.default_models())


def test_the_output_is_a_new_run_folder_and_results_are_not_written_over(tmp_path, monkeypatch):
    import argparse

    import pytest

    monkeypatch.setattr(eval_quality, "RUNS_DIR", tmp_path / "runs")
    p = eval_quality.add_arguments(argparse.ArgumentParser())
    quick = eval_quality.output_dir(p.parse_args(["--quick"]), now=0)
    assert quick == tmp_path / "runs" / "19700101-000000-quick"
    quick.mkdir(parents=True)
    assert eval_quality.output_dir(p.parse_args(["--quick"]), now=0).name == "19700101-000000-quick-1"
    assert eval_quality.output_dir(p.parse_args([]), now=0).name == "19700101-000000"
    committed = tmp_path / "recipe"
    committed.mkdir()
    assert eval_quality.output_dir(p.parse_args(["--out", str(committed)])) == committed  # empty: fine
    (committed / "eval_quality.json").write_text("{}")
    with pytest.raises(eval_quality.EvalError, match="--overwrite"):
        eval_quality.output_dir(p.parse_args(["--out", str(committed)]))
    assert eval_quality.output_dir(p.parse_args(["--out", str(committed), "--overwrite"])) == committed
    # the committed results of the repository are such folders
    assert (eval_quality.REPO / "benchmarks" / "results" / "eval" / "recipe" / "eval_quality.json").is_file()


def test_progress_lines_are_flushed_with_the_time(capsys):
    say = eval_quality.Progress()
    say("[parent] 4/12 prompts")
    assert capsys.readouterr().out.rstrip().endswith("s] [parent] 4/12 prompts")
