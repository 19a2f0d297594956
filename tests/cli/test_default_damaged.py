"""The default model's files in ``$UNMASK_HOME`` damaged after they were made (break-it findings): every case is one
line naming the file or is repaired, never a traceback and never a silently different model (cli/serve.py
``default_model``, ``default_with_adapter``; engine/adapter_files.py ``parent_hash``; training/realmodel.py)."""
from __future__ import annotations

import json

import pytest

import tiny
from default_stand_ins import patch_default, write_default
from unmask.engine.adapter_files import HASH_CACHE, parent_hash
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError


@pytest.fixture
def home(monkeypatch, tmp_path):
    """(conversion dir, shipped adapter dir), patched in as the default's."""
    parent, package = write_default(tmp_path)
    patch_default(monkeypatch, parent, package)
    return parent, package


def _weights(parent):
    return next(f for f in parent.glob("*.safetensors"))


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_damaged_parent_weight_file_is_one_line_naming_it(home, damage):
    from unmask.cli.main import UsageError
    from unmask.cli import serve

    parent, _ = home
    f = _weights(parent)
    (parent / HASH_CACHE).unlink(missing_ok=True)
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    else:
        with open(f, "r+b") as fh:
            fh.write(b"\xff" * 8)
    with pytest.raises(UsageError) as exc:
        serve.default_model()
    msg = str(exc.value)
    assert "\n" not in msg and str(f) in msg and f"remove {parent}" in msg, msg


@pytest.mark.parametrize("cache", [b"xx", b"\xff\xfe", b"[1, 2]", b'{"files": 3}'])
def test_a_damaged_hash_cache_is_recomputed(home, cache):
    parent, _ = home
    want = parent_hash(parent)
    (parent / HASH_CACHE).write_bytes(cache)
    assert parent_hash(parent) == want
    assert json.loads((parent / HASH_CACHE).read_text())["sha256"] == want  # rewritten


@pytest.mark.parametrize("where", ["header", "data"])
def test_an_adapter_copy_damaged_in_place_is_replaced(home, where):
    """Same size, other bytes: the copy is compared byte for byte with the shipped adapter, so it is copied again
    instead of failing every start (header) or serving another adapter without a word (data)."""
    from unmask.cli import serve

    parent, shipped = home
    path = serve.default_with_adapter(parent)[0]
    copy = parent.parent / "smollm2-135m-a2d-mask-adapter" / "mask_adapter.safetensors"
    good = copy.read_bytes()
    with open(copy, "r+b") as fh:
        fh.seek(8 if where == "header" else len(good) - 64)
        fh.write(b"\x7f" * 16)
    assert copy.read_bytes() != good and copy.stat().st_size == len(good)
    assert serve.default_with_adapter(parent)[0] == path
    assert copy.read_bytes() == good == (shipped / "mask_adapter.safetensors").read_bytes()


def test_an_adapter_copy_missing_its_weights_is_replaced(home):
    from unmask.cli import serve

    parent, shipped = home
    serve.default_with_adapter(parent)
    copy = parent.parent / "smollm2-135m-a2d-mask-adapter" / "mask_adapter.safetensors"
    copy.unlink()
    serve.default_with_adapter(parent)
    assert copy.read_bytes() == (shipped / "mask_adapter.safetensors").read_bytes()


@pytest.mark.parametrize("config, says", [(b"{bad", "is not JSON"), (b'{"model_type": "llama"}', "no dllm section"),
                                          (None, "is missing")])
def test_a_conversion_directory_without_a_checkpoint_names_config_json(tmp_path, config, says):
    """A damaged conversion used to be converted into again, which failed with "OUT exists and is not an empty
    directory" at every start; now the error names config.json and the way out, and nothing is deleted."""
    from unmask.training.convert import ConversionError
    from unmask.training.realmodel import ensure_default_converted

    out = tmp_path / "smollm2-135m-a2d"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    if config is not None:
        (out / "config.json").write_bytes(config)
    with pytest.raises(ConversionError) as exc:
        ensure_default_converted(out=out)
    msg = str(exc.value)
    assert str(out / "config.json") in msg and says in msg and "remove the directory" in msg, msg
    assert (out / "model.safetensors").read_bytes() == b"weights"


def test_parent_hash_names_a_damaged_file(tmp_path):
    m = tiny.loaded()
    write_checkpoint(tmp_path / "p", m.model, m.tokenizer, m.dllm)
    f = _weights(tmp_path / "p")
    with open(f, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(CheckpointError, match=str(f)):
        parent_hash(tmp_path / "p")


@pytest.mark.parametrize("stand_in", ["file", "link-to-dir", "dangling-link"])
def test_something_else_in_place_of_the_adapter_copy_is_replaced(home, tmp_path, stand_in):
    """A file or a link where the copy's directory belongs (break-it: NotADirectoryError, and a .tmp-* directory
    left behind every run)."""
    from unmask.cli import serve

    parent, shipped = home
    out = parent.parent / "smollm2-135m-a2d-mask-adapter"
    if stand_in == "file":
        out.write_text("junk")
    elif stand_in == "link-to-dir":
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    else:
        out.symlink_to(tmp_path / "nowhere")
    assert serve.default_with_adapter(parent)[0] == str(out)
    assert out.is_dir() and not out.is_symlink()
    assert (out / "mask_adapter.safetensors").read_bytes() == (shipped / "mask_adapter.safetensors").read_bytes()
    assert not list(parent.parent.glob("*.tmp-*"))


def test_processes_setting_up_the_copy_at_once(home):
    """Starts at the same moment over a damaged copy (break-it: one died with 'Directory not empty' and left a
    .tmp-* directory): a lock lets one process check and replace the copy at a time. Three processes damage the
    copy and set it up again 60 times each; none fails, and a last start leaves the shipped bytes."""
    import subprocess
    import sys
    from pathlib import Path

    parent, shipped = home
    from unmask.cli import serve

    serve.default_with_adapter(parent)
    copy = parent.parent / "smollm2-135m-a2d-mask-adapter" / "mask_adapter.safetensors"
    with open(copy, "r+b") as fh:
        fh.seek(-8, 2)
        fh.write(b"\x01" * 8)
    tests = Path(__file__).resolve().parents[1]
    script = (f"import sys; sys.path.insert(0, {str(tests)!r})\n"
              "from pathlib import Path\nimport unmask.default_adapter as pkg\n"
              f"pkg.directory = lambda: Path({str(shipped)!r})\n"
              "from unmask.cli import serve\n"
              f"copy = Path({str(copy)!r})\n"
              "for _ in range(60):\n"
              "    try:\n"
              "        with open(copy, 'r+b') as fh:\n"
              "            fh.seek(-8, 2); fh.write(b'\\x02' * 8)\n"
              "    except OSError:\n"
              "        pass\n"
              f"    serve.default_with_adapter(Path({str(parent)!r}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    serve.default_with_adapter(parent)
    assert copy.read_bytes() == (shipped / "mask_adapter.safetensors").read_bytes()
    assert not list(parent.parent.glob("*.tmp-*"))


@pytest.mark.parametrize("stand_in", ["directory", "dangling-link"])
def test_something_else_in_place_of_a_parent_weight_file_is_one_line(home, tmp_path, stand_in):
    from unmask.cli import serve
    from unmask.cli.main import UsageError

    parent, _ = home
    f = _weights(parent)
    f.unlink()
    (parent / HASH_CACHE).unlink(missing_ok=True)
    if stand_in == "directory":
        f.mkdir()
    else:
        f.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError) as exc:
        serve.default_model()
    assert "\n" not in str(exc.value) and str(f) in str(exc.value) and "cannot be read" in str(exc.value)
