"""Broken mask-row adapter files are refused at load in one line naming the file and the problem
(engine/adapter_check.py; docs/design.md#checks-at-load and #mask-row-adapter). Before, these variants (breaker) were
tracebacks (KeyError, AttributeError, IndexError), loaded and answered 500s or empty texts (NaN/inf tensors or alpha, a
mask embedding of the wrong shape), or were silently accepted (integer tensors, targets disagreeing with the
tensors, stray layer indices and projections)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from unmask.engine.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, parent_hash, write_adapter
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError
from unmask.engine.model import load_model

A0, B0 = "layers.0.q_proj.lora_A", "layers.0.q_proj.lora_B"
EOS = 2  # tiny's <|im_end|> (one of its eos_token_ids)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corrupt_adapters")
    m = tiny.loaded()
    write_checkpoint(tmp / "parent", m.model, m.tokenizer, m.dllm)
    write_adapter(tmp / "adapter", tiny.random_adapter_weights(m), {"sha256": parent_hash(tmp / "parent")})
    return tmp


def _tensors(fn):
    def edit(d):
        t = load_file(str(d / ADAPTER_WEIGHTS))
        fn(t)
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / ADAPTER_WEIGHTS))
    return edit


def _cfg(fn):
    def edit(d):
        c = json.loads((d / ADAPTER_CONFIG).read_text())
        fn(c)
        (d / ADAPTER_CONFIG).write_text(json.dumps(c))
    return edit


def _raw_cfg(old, new):
    def edit(d):
        f = d / ADAPTER_CONFIG
        text = f.read_bytes()
        assert old in text
        f.write_bytes(text.replace(old, new))
    return edit


def _drop(*names):
    return _tensors(lambda t: [t.pop(n) for n in names])


def _set(name, value):
    return _tensors(lambda t: t.update({name: value(t[name]) if callable(value) else value}))


def _copy_pair(prefix):
    return _tensors(lambda t: t.update({f"{prefix}.lora_A": t[A0].clone(), f"{prefix}.lora_B": t[B0].clone()}))


WEIGHTS_FILE = f"{ADAPTER_WEIGHTS}: "
CONFIG_FILE = f"{ADAPTER_CONFIG}: "
VARIANTS = {
    # tracebacks before
    "pair_missing": (_drop("layers.1.down_proj.lora_A", "layers.1.down_proj.lora_B"),
                     WEIGHTS_FILE + r".*2 missing \(layers.1.down_proj.lora_A, layers.1.down_proj.lora_B\)"),
    "B_missing": (_drop(B0), WEIGHTS_FILE + r".*1 missing \(layers.0.q_proj.lora_B\)"),
    "targets_duplicated": (_cfg(lambda c: c.update(targets=c["targets"] * 2)),
                           CONFIG_FILE + r"field 'targets'.*listed more than once"),
    "B_1d": (_set(B0, lambda v: v.flatten().clone()), WEIGHTS_FILE + rf"tensor {B0} has shape \[\d+\], expected"),
    "A_scalar": (_set(A0, torch.tensor(1.0)), WEIGHTS_FILE + rf"tensor {A0} has shape \[\], expected \[4, "),
    "A_3d": (_set(A0, lambda v: v[None].clone()), WEIGHTS_FILE + rf"tensor {A0} has shape \[1, "),
    "A_wrong_in": (_set(A0, lambda v: torch.zeros(v.shape[0], v.shape[1] + 1)), WEIGHTS_FILE + rf"tensor {A0} "),
    "B_wrong_rank": (_set(B0, lambda v: torch.zeros(v.shape[0], 3)), WEIGHTS_FILE + rf"tensor {B0} has shape"),
    # 500s before
    "mask_embedding_2xH": (_set("mask_embedding", lambda v: v[None].repeat(2, 1).clone()),
                           WEIGHTS_FILE + r"tensor mask_embedding has shape \[2, \d+\], expected \[\d+\]"),
    "mask_embedding_10": (_set("mask_embedding", lambda v: v[:10].clone()),
                          WEIGHTS_FILE + r"tensor mask_embedding has shape \[10\]"),
    # silently wrong before
    "nan_A": (_set(A0, lambda v: v.clone().fill_(float("nan"))), WEIGHTS_FILE + rf"tensor {A0} holds \d+ non-finite"),
    "inf_B": (_set(B0, lambda v: v.clone().fill_(float("inf"))), WEIGHTS_FILE + rf"tensor {B0} holds \d+ non-finite"),
    "nan_mask_embedding": (_set("mask_embedding", lambda v: v.clone().fill_(float("nan"))),
                           WEIGHTS_FILE + r"tensor mask_embedding holds \d+ non-finite"),
    "alpha_NaN": (_raw_cfg(b'"alpha": 8.0', b'"alpha": NaN'), CONFIG_FILE + r"field 'alpha': must be a finite"),
    "alpha_Infinity": (_raw_cfg(b'"alpha": 8.0', b'"alpha": Infinity'), CONFIG_FILE + r"field 'alpha'"),
    "alpha_1e308": (_cfg(lambda c: c.update(alpha=1e308)), CONFIG_FILE + r"field 'alpha'.*alpha / rank <= 1024"),
    "alpha_negative": (_cfg(lambda c: c.update(alpha=-8)), CONFIG_FILE + r"field 'alpha'"),
    "rank_0": (_cfg(lambda c: c.update(rank=0)), CONFIG_FILE + r"field 'rank': must be an integer in 1\.\.4096"),
    "rank_other": (_cfg(lambda c: c.update(rank=8)), WEIGHTS_FILE + r"tensor layers.0.\w+.lora_A has shape \[4, \d+\], expected \[8"),
    # served silently before (issue 41): no trained adapter looks like these
    "alpha_1e30": (_cfg(lambda c: c.update(alpha=1e30)), CONFIG_FILE + r"field 'alpha'.*alpha / rank <= 1024"),
    "alpha_scale_2048": (_cfg(lambda c: c.update(alpha=c["rank"] * 2048.0)), CONFIG_FILE + r"field 'alpha'"),
    "rank_huge": (_cfg(lambda c: c.update(rank=100000)), CONFIG_FILE + r"field 'rank'"),
    "version_99": (_cfg(lambda c: c.update(version=99)), CONFIG_FILE + r"field 'version': 99 is not a mask-adapter"),
    "version_string": (_cfg(lambda c: c.update(version="1")), CONFIG_FILE + r"field 'version': '1'"),
    "weights_1e4": (_set(A0, lambda v: v.clone().fill_(1e4)), WEIGHTS_FILE + rf"tensor {A0} holds a value of magnitude 1e\+04"),
    "weights_1e38": (_set(B0, lambda v: v.clone().fill_(-1e38)), WEIGHTS_FILE + rf"tensor {B0} holds a value of magnitude 1e\+38"),
    "mask_is_eos": (_cfg(lambda c: c.update(mask_token_id=EOS)), CONFIG_FILE + r"field 'mask_token_id': \d+ is also eos_token_ids"),
    # accepted silently before
    "mask_embedding_1": (_set("mask_embedding", lambda v: v[:1].clone()),
                         WEIGHTS_FILE + r"tensor mask_embedding has shape \[1\]"),
    "mask_embedding_scalar": (_set("mask_embedding", torch.tensor(1.0)),
                              WEIGHTS_FILE + r"tensor mask_embedding has shape \[\]"),
    "A_int32": (_set(A0, lambda v: v.to(torch.int32)), WEIGHTS_FILE + rf"tensor {A0} has dtype I32"),
    "A_int8": (_set(A0, lambda v: v.to(torch.int8)), WEIGHTS_FILE + rf"tensor {A0} has dtype I8"),
    "mask_embedding_int32": (_set("mask_embedding", lambda v: v.to(torch.int32)),
                             WEIGHTS_FILE + r"tensor mask_embedding has dtype I32"),
    "targets_subset": (_cfg(lambda c: c.update(targets=["q_proj"])), WEIGHTS_FILE + r".*24 unexpected \(layers.0.down_proj"),
    "layer_minus_1": (_copy_pair("layers.-1.q_proj"), WEIGHTS_FILE + r".*2 unexpected \(layers.-1.q_proj.lora_A"),
    "layer_x": (_copy_pair("layers.x.q_proj"), WEIGHTS_FILE + r".*2 unexpected \(layers.x.q_proj.lora_A"),
    "layer_past_the_end": (_copy_pair("layers.2.q_proj"), WEIGHTS_FILE + r".*2 unexpected \(layers.2.q_proj.lora_A"),
    "unknown_projection": (_copy_pair("layers.0.foo_proj"), WEIGHTS_FILE + r".*unexpected \(layers.0.foo_proj.lora_A"),
    "junk_tensor": (_tensors(lambda t: t.update(junk=torch.zeros(3))), WEIGHTS_FILE + r".*1 unexpected \(junk\)"),
    # unclear messages before
    "config_not_utf8": (lambda d: (d / ADAPTER_CONFIG).write_bytes(b"\xff\xfe\x00garbage"),
                        CONFIG_FILE + r"not UTF-8 text"),
    "parent_sha256_missing": (_cfg(lambda c: c["parent"].pop("sha256")), CONFIG_FILE + r"field 'parent.sha256'"),
    "targets_string": (_cfg(lambda c: c.update(targets="q_proj")), CONFIG_FILE + r"field 'targets': must be"),
    "truncated_weights": (lambda d: (d / ADAPTER_WEIGHTS).write_bytes((d / ADAPTER_WEIGHTS).read_bytes()[:200]),
                          WEIGHTS_FILE + r"truncated"),
}


def variant(good, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(good / "adapter", d)
    VARIANTS[name][0](d)
    return d


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_broken_adapter_is_refused_in_one_line_naming_file_and_problem(good, tmp_path, name):
    d = variant(good, tmp_path, name)
    with pytest.raises(CheckpointError) as err:
        load_model(good / "parent", adapter=d)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(d)), msg
    assert re.search(VARIANTS[name][1], msg), msg


def test_the_good_adapter_and_one_without_mask_embedding_load(good, tmp_path):
    """The checks refuse nothing the writer writes (the mask embedding is optional: the parent's row)."""
    assert load_model(good / "parent", adapter=good / "adapter").has_row_variant
    d = tmp_path / "no_emb"
    shutil.copytree(good / "adapter", d)
    _drop("mask_embedding")(d)
    assert load_model(good / "parent", adapter=d).has_row_variant


def test_serve_subprocess_exits_2_with_one_line(good, tmp_path):
    d = variant(good, tmp_path, "pair_missing")
    r = subprocess.run([sys.executable, "-m", "unmask.cli.main", "serve", str(good / "parent"), "--adapter", str(d),
                        "--port", "0"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"{d / ADAPTER_WEIGHTS}: " in r.stderr and "missing (layers.1.down_proj.lora_A" in r.stderr
