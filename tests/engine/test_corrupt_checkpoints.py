"""Corrupt, incomplete and half-written checkpoints are refused at load with one line naming the file and the
problem (docs/design.md#checks-at-load, issue 22): through ``load_model`` and through ``unmask serve``.

Every variant starts from one tiny a2d checkpoint written by ``write_checkpoint`` and breaks one thing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny import loaded as tiny_loaded
from unmask.engine import CheckpointError, load_model
from unmask.engine.checkpoint import WRITER_MARKER, mark_temporary, write_checkpoint
from unmask.engine.checkpoint_check import check_finite

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    m = tiny_loaded()
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "good", m.model, m.tokenizer, m.dllm)


def variant(good: Path, tmp_path: Path, name: str = "bad") -> Path:
    d = tmp_path / name
    shutil.copytree(good, d)
    return d


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_weights(d: Path, fn) -> None:
    state = load_file(str(d / WEIGHTS))
    fn(state)
    save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})


def refused(d: Path, *patterns: str) -> str:
    """Load ``d``, expect a one-line CheckpointError naming a file inside ``d`` and matching ``patterns``."""
    with pytest.raises(CheckpointError) as info:
        load_model(d, device="cpu", weights="native")
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(d)), msg
    for p in patterns:
        assert p in msg, (p, msg)
    return msg


def test_the_good_checkpoint_loads(good, tmp_path):
    lm = load_model(good, device="cpu", weights="native")
    assert lm.vocab_size == 321


def test_tied_and_sharded_checkpoints_load(tmp_path):
    m = tiny_loaded(tie_word_embeddings=True)
    d = write_checkpoint(tmp_path / "tied", m.model, m.tokenizer, m.dllm)
    assert "lm_head.weight" not in load_file(str(d / WEIGHTS))  # a tied head is not stored: not "missing"
    load_model(d, device="cpu", weights="native")
    m = tiny_loaded()
    m.model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    s = write_checkpoint(tmp_path / "sharded2", m.model, m.tokenizer, m.dllm)
    for f in s.glob("model*.safetensors*"):
        f.unlink()
    for f in (tmp_path / "sharded").glob("model*.safetensors*"):
        shutil.copy(f, s / f.name)
    assert (s / "model.safetensors.index.json").is_file()
    load_model(s, device="cpu", weights="native")


@pytest.mark.parametrize("keep", [0, 4, 7, 100, 0.5, -1])
def test_truncated_safetensors(good, tmp_path, keep):
    d = variant(good, tmp_path)
    data = (d / WEIGHTS).read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    (d / WEIGHTS).write_bytes(data[:n])
    refused(d, f"{d / WEIGHTS}:")


@pytest.mark.parametrize("kind", ["random", "zeros", "json", "text", "appended", "bad_offsets"])
def test_garbage_safetensors(good, tmp_path, kind):
    d = variant(good, tmp_path)
    f = d / WEIGHTS
    if kind == "random":
        f.write_bytes(os.urandom(5000))
    elif kind == "zeros":
        f.write_bytes(bytes(5000))
    elif kind == "json":
        f.write_text(json.dumps({"not": "weights"}))
    elif kind == "text":
        f.write_bytes((8).to_bytes(8, "little") + b"notjson!" + b"x" * 64)
    elif kind == "appended":
        f.write_bytes(f.read_bytes() + b"\0" * 10)
    else:  # a header whose offsets do not fit the shapes
        header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
        f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    refused(d, f"{f}:")


@pytest.mark.parametrize("field,value", [
    ("hidden_size", "abc"), ("hidden_size", -1), ("hidden_size", 0), ("hidden_size", 1.5), ("hidden_size", True),
    ("num_attention_heads", "4"), ("num_hidden_layers", 0), ("vocab_size", "321"), ("intermediate_size", None),
    ("max_position_embeddings", -5), ("rms_norm_eps", "x"), ("rms_norm_eps", -1e-6), ("num_key_value_heads", 3),
    ("hidden_size", 62), ("hidden_size", 32), ("intermediate_size", 64), ("vocab_size", 300),
])
def test_wrongly_typed_or_sized_config_fields(good, tmp_path, field, value):
    d = variant(good, tmp_path)
    edit_config(d, lambda c: c.update({field: value}))
    if value is None:  # a required size removed: transformers' own default would build a wrong model
        edit_config(d, lambda c: c.pop(field))
    refused(d, "config.json")  # the field itself, or the tensors that do not match the model it describes


@pytest.mark.parametrize("field,value", [
    ("mask_token_id", 5000), ("mask_token_id", 321), ("pad_token_id", 10 ** 6), ("eos_token_ids", [0, 999]),
    ("suppress_token_ids", [400]), ("eos_token_ids", ["<eos>"]), ("mask_token_id", -1),
])
def test_token_ids_outside_the_vocabulary(good, tmp_path, field, value):
    d = variant(good, tmp_path)
    edit_config(d, lambda c: c["dllm"].update({field: value}))
    refused(d, "config.json:dllm.", field)


def test_block_size_beyond_the_context(good, tmp_path):
    d = variant(good, tmp_path)
    edit_config(d, lambda c: c["dllm"].update(block_size=4096))
    refused(d, "dllm.block_size", "context")


@pytest.mark.parametrize("layers,kind", [(3, "missing"), (1, "unexpected"), (8, "missing")])
def test_changed_num_hidden_layers(good, tmp_path, layers, kind):
    d = variant(good, tmp_path)
    edit_config(d, lambda c: c.update(num_hidden_layers=layers))
    refused(d, WEIGHTS, kind, "model.layers.")


@pytest.mark.parametrize("change", ["drop_norm", "drop_head", "extra", "reshape"])
def test_missing_unexpected_or_reshaped_tensors(good, tmp_path, change):
    d = variant(good, tmp_path)
    if change == "drop_norm":
        edit_weights(d, lambda s: s.pop("model.norm.weight"))
        pattern = "missing (model.norm.weight)"
    elif change == "drop_head":
        edit_weights(d, lambda s: s.pop("lm_head.weight"))  # untied: the head must be stored
        pattern = "lm_head.weight"
    elif change == "extra":
        edit_weights(d, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(3)}))
        pattern = "unexpected (model.layers.0.extra.weight)"
    else:
        edit_weights(d, lambda s: s.update({"model.norm.weight": torch.ones(32)}))
        pattern = "shape [32]"
    refused(d, pattern)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.int64])
@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_integer_dtype_where_a_float_weight_is_expected(good, tmp_path, name, dtype):
    """F32 -> I32 (same byte size, so the file stays consistent) was cast silently at load (breaker)."""
    d = variant(good, tmp_path)
    edit_weights(d, lambda st: st.__setitem__(name, st[name].to(dtype)))
    refused(d, WEIGHTS, name, "dtype", "floating-point")


BAD_TEMPLATES = [  # (template, the Jinja error line, the stage)
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}\n{% if x %}", 3, "compile"),      # unclosed if
    ("{{ messages[0]['content'] }}\n{{ bos_token + }}", 2, "compile"),                         # syntax error
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}\n{{ raise_exception('no system message') }}", 2,
     "render"),                                                                                  # raises at render
    ("line one\n{{ messages | frobnicate }}", 2, "compile"),                                    # unknown filter
]


@pytest.mark.parametrize("template,line,stage", BAD_TEMPLATES)
def test_broken_chat_template_is_refused_at_load(good, tmp_path, template, line, stage):
    """A broken chat_template.jinja let the server start healthy and fail every chat request (breaker)."""
    d = variant(good, tmp_path)
    (d / "chat_template.jinja").write_text(template)
    msg = refused(d, f"chat_template.jinja:{line}:", f"does not {stage}")
    assert "Template" in msg or "Error" in msg, msg


def test_a_working_chat_template_file_loads(good, tmp_path):
    d = variant(good, tmp_path)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                           "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert load_model(d, device="cpu", weights="native").tokenizer.chat_template.startswith("{% for m")


@pytest.mark.parametrize("name,value", [
    ("model.layers.0.mlp.down_proj.weight", float("nan")), ("model.embed_tokens.weight", float("inf")),
    ("lm_head.weight", -float("inf")), ("model.norm.weight", float("nan")),
])
def test_non_finite_weights(good, tmp_path, name, value):
    d = variant(good, tmp_path)

    def poison(state):
        state[name].view(-1)[-1] = value
    edit_weights(d, poison)
    refused(d, f"{d / WEIGHTS}: tensor {name} holds 1 non-finite")


@pytest.mark.parametrize("field,value,other", [
    ("mask_token_id", 0, "eos_token_ids"), ("mask_token_id", 2, "eos_token_ids"), ("pad_token_id", 320, "pad_token_id"),
])
def test_mask_token_shared_with_eos_or_pad(good, tmp_path, field, value, other):
    """A mask id equal to an EOS/pad id loads but decodes nothing (issue 41): refused, naming the field."""
    d = variant(good, tmp_path)
    edit_config(d, lambda c: c["dllm"].update({field: value}))
    refused(d, "config.json:dllm.mask_token_id: ", f"is also {other}")


def test_mask_token_shared_with_bos(good, tmp_path):
    from transformers import AutoTokenizer

    d = variant(good, tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["bos_token"] = "<|im_start|>"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    bos = AutoTokenizer.from_pretrained(str(d)).bos_token_id
    edit_config(d, lambda c: c["dllm"].update(mask_token_id=bos))
    refused(d, "config.json:dllm.mask_token_id: ", "bos_token_id")


@pytest.mark.parametrize("name,value", [
    ("model.layers.0.mlp.down_proj.weight", 1e4), ("model.embed_tokens.weight", -3e38), ("model.norm.weight", 2e3),
])
def test_weights_of_impossible_magnitude(good, tmp_path, name, value):
    """Finite weights no trained model has (1e4-1e38 in issue 41's files) are refused; the option lifts the bound."""
    d = variant(good, tmp_path)

    def scale(state):
        state[name].view(-1)[-1] = value
    edit_weights(d, scale)
    refused(d, f"{d / WEIGHTS}: tensor {name} holds a value of magnitude", "above 1000")
    load_model(d, device="cpu", weights="native", max_weight_magnitude=0)
    load_model(d, device="cpu", weights="native", max_weight_magnitude=1e39)


def test_finite_check_exact_when_the_fast_sum_overflows(tmp_path):
    """Huge finite weights overflow the fast path's sum; the elementwise check then finds nothing."""
    layer = torch.nn.Linear(1000, 1000)
    with torch.no_grad():
        layer.weight.fill_(3e38)
    check_finite(layer, tmp_path, max_magnitude=0)  # the magnitude bound off: finite is all that is checked
    with torch.no_grad():
        layer.weight[7, 7] = float("nan")
    with pytest.raises(CheckpointError, match="weight holds 1 non-finite"):
        check_finite(layer, tmp_path, max_magnitude=0)


@pytest.mark.parametrize("writer", ["dead", "alive", "unreadable"])
def test_half_written_staging_directory(good, tmp_path, writer):
    d = variant(good, tmp_path, "out.verify-12345")
    host = os.uname().nodename
    if writer == "dead":
        (d / WRITER_MARKER).write_text(f"{host} 999999999\n")
    elif writer == "alive":
        (d / WRITER_MARKER).write_text(f"{host} 1\n")
    else:
        (d / WRITER_MARKER).write_text("")
    refused(d, WRITER_MARKER, "staging")


def test_a_writer_may_load_its_own_staging_directory(good, tmp_path):
    """An export verifies its staging directory (marked by this process) by loading it: that stays allowed."""
    d = variant(good, tmp_path, "out.verify-mine")
    mark_temporary(d)
    load_model(d, device="cpu", weights="native")


@pytest.mark.parametrize("remove,pattern", [
    (["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"], "no tokenizer file"),
    (["tokenizer.json"], "no tokenizer file"),
    ([WEIGHTS], "no weights found"),
    ([WEIGHTS, "tokenizer.json"], "no weights found"),
])
def test_partial_checkpoint(good, tmp_path, remove, pattern):
    d = variant(good, tmp_path)
    for name in remove:
        (d / name).unlink()
    msg = refused(d, "incomplete checkpoint", pattern)
    assert "sentencepiece" not in msg and "backend tokenizer" not in msg


def test_missing_shard_of_an_index(good, tmp_path):
    d = variant(good, tmp_path)
    (d / WEIGHTS).rename(d / "model-00001-of-00002.safetensors")
    names = load_file(str(d / "model-00001-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused(d, "model-00002-of-00002.safetensors: missing")


@pytest.mark.parametrize("breakage", ["truncate", "mask", "layers", "nan", "staging"])
def test_serve_refuses_in_one_line(good, tmp_path, capsys, breakage):
    from unmask.cli.main import main

    d = variant(good, tmp_path)
    if breakage == "truncate":
        (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:1000])
    elif breakage == "mask":
        edit_config(d, lambda c: c["dllm"].update(mask_token_id=5000))
    elif breakage == "layers":
        edit_config(d, lambda c: c.update(num_hidden_layers=3))
    elif breakage == "nan":
        edit_weights(d, lambda s: s["model.norm.weight"].fill_(float("nan")))
    else:
        (d / WRITER_MARKER).write_text("elsewhere 42\n")
    rc = main(["serve", str(d), "--port", "0"])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1 and err.startswith(f"unmask serve: error: {d}"), err


def test_serve_subprocess_exits_nonzero_without_traceback(good, tmp_path):
    d = variant(good, tmp_path)
    (d / WEIGHTS).write_bytes(os.urandom(4096))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "unmask.cli.main", "serve", str(d), "--port", "0"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"{d / WEIGHTS}: not a safetensors file" in r.stderr
    assert time.time() - t0 < 60  # refused before any weight is read (the wall time is mostly importing torch)


def test_writers_with_the_same_pid_never_share_a_staging_directory(good, tmp_path, monkeypatch):
    """In containers every writer may be pid 1, and two containers can share a volume: a staging directory named
    by the pid alone was the other writer's, and write_checkpoint deleted it as its own leftover (breaker)."""
    from unmask.engine.checkpoint import unique_suffix

    monkeypatch.setattr(os, "getpid", lambda: 1)
    assert unique_suffix() != unique_suffix() and unique_suffix().startswith("1-")
    m = tiny_loaded()
    out = tmp_path / "out"
    other = tmp_path / "out.tmp-1"                # another container's writer (also pid 1), still writing
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"half written")
    write_checkpoint(out, m.model, m.tokenizer, m.dllm)
    assert (other / "model.safetensors").read_bytes() == b"half written"
    assert load_model(out, device="cpu", weights="native").vocab_size == m.vocab_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp-1"]
