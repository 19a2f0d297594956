"""Quantized export round trip (docs/design.md#decisions): saved tensors equal a fresh-process quantization of the same
weights, reloaded logits equal the exporter's - also after the exporting process ran a forward on a quantized model
(the bitsandbytes 0.50 AVX512-BF16 repack trap), and a model that ran a forward is never written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny
from unmask.cli.main import main as cli_main
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.model import load_model
from unmask.training.export import ExportError, export, load_quantized_fresh, probe_ids, write_quantized

ROOT = Path(__file__).resolve().parents[2]

_FRESH = """
import sys, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
src, out = sys.argv[1], sys.argv[2]
for q, cfg in (("nf4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_compute_dtype=torch.float32)),
               ("int8", BitsAndBytesConfig(load_in_8bit=True))):
    m = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map={"": "cpu"}, dtype=torch.float32)
    m.save_pretrained(f"{out}/{q}")
"""


@pytest.fixture(scope="module")
def src_and_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    lm = tiny.loaded()
    write_checkpoint(d / "src", lm.model, lm.tokenizer, lm.dllm)
    r = subprocess.run([sys.executable, "-c", _FRESH, str(d / "src"), str(d / "ref")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return d


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_saved_tensors_equal_fresh_process_and_logits_equal(src_and_reference, tmp_path, quantization):
    d = src_and_reference
    # the trap: this process runs a CPU forward on a quantized model of the same weights before exporting
    trapped = load_quantized_fresh(d / "src", quantization, torch.device("cpu"))
    lm_src = load_model(d / "src", device="cpu", weights="native")
    with torch.no_grad():
        trapped(input_ids=probe_ids(lm_src.tokenizer))
    with pytest.raises(ExportError, match="run a forward"):
        write_quantized(tmp_path / "bad", trapped, lm_src.tokenizer, lm_src.dllm)
    assert not (tmp_path / "bad").exists()

    res = export(d / "src", tmp_path / "out", quantization=quantization)
    assert res["max_abs_logit_diff"] == 0.0
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = load_file(str(d / "ref" / quantization / "model.safetensors"))
    assert set(saved) == set(ref)
    for name in ref:
        assert saved[name].dtype == ref[name].dtype and torch.equal(saved[name], ref[name]), name
    # reloaded logits == the exporter's (a fresh quantized model's, forward after writing)
    exporter = load_quantized_fresh(d / "src", quantization, torch.device("cpu"))
    reloaded = load_model(tmp_path / "out", device="cpu", weights="native")
    ids = probe_ids(reloaded.tokenizer)
    with torch.no_grad():
        a = exporter(input_ids=ids).logits
        b = reloaded.model(input_ids=ids).logits
        c = lm_src.model(input_ids=ids).logits
    assert torch.equal(a, b)
    assert not torch.equal(b, c)  # really quantized
    assert reloaded.dllm == lm_src.dllm


def test_export_none_and_errors(src_and_reference, tmp_path, capsys):
    d = src_and_reference
    assert cli_main(["export", str(d / "src"), str(tmp_path / "plain"), "--quantization", "none"]) == 0
    a, b = load_file(str(d / "src" / "model.safetensors")), load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert "threshold" not in json.loads((tmp_path / "plain" / "config.json").read_text())["dllm"]["default_sampling"]
    assert cli_main(["export", str(d / "src"), str(tmp_path / "fast"), "--quantization", "none",
                     "--default-threshold", "0.7"]) == 0
    assert json.loads((tmp_path / "fast" / "config.json").read_text())["dllm"]["default_sampling"]["threshold"] == 0.7
    # and cleared again by a re-export of that export
    assert cli_main(["export", str(tmp_path / "fast"), str(tmp_path / "cleared"), "--quantization", "none",
                     "--no-default-threshold"]) == 0
    assert "threshold" not in json.loads((tmp_path / "cleared" / "config.json").read_text())["dllm"]["default_sampling"]
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "fast"), str(tmp_path / "both"), "--quantization", "none",
                     "--no-default-threshold", "--default-threshold", "0.5"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert cli_main(["export", str(d / "src"), str(tmp_path / "bad"), "--quantization", "none",
                     "--default-threshold", "2"]) == 2
    assert "--default-threshold" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert cli_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err
    assert cli_main(["export", str(d / "src"), str(tmp_path / "plain")]) == 2  # non-empty output
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["export", str(d / "ref" / "nf4"), str(tmp_path / "y")]) == 2


def test_failed_verification_leaves_nothing_behind(src_and_reference, tmp_path, monkeypatch):
    """A reload check that fails must not leave a half-trusted export under OUT (nor a staging directory), and
    must not touch an export already there (overwrite)."""
    import unmask.training.export as ex

    d = src_and_reference
    monkeypatch.setattr(ex, "verify_export", lambda *a, **k: 0.5)
    with pytest.raises(ExportError, match="nothing was written"):
        export(str(d / "src"), str(tmp_path / "out"), quantization="none")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    export(str(d / "src"), str(tmp_path / "out"), quantization="none")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    monkeypatch.setattr(ex, "verify_export", lambda *a, **k: 0.5)
    with pytest.raises(ExportError):
        export(str(d / "src"), str(tmp_path / "out"), quantization="nf4", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_staging_directory_of_a_killed_export_is_removed(src_and_reference, tmp_path):
    """kill -9 during verification leaves ``<out>.verify-<pid>`` (a whole model copy); the next export removes it,
    and the final export carries no writer marker."""
    import socket
    import subprocess
    import sys

    from unmask.engine.checkpoint import WRITER_MARKER

    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True).stdout)
    stale = tmp_path / f"out.verify-{pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    (stale / WRITER_MARKER).write_text(f"{socket.gethostname()} {pid}\n")
    export(str(src_and_reference / "src"), str(tmp_path / "out"), quantization="none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not (tmp_path / "out" / WRITER_MARKER).exists()
