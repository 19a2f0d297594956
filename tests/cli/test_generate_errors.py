"""``unmask generate``'s errors name its own options (cli/generate.py): a rule between options found by the engine
(a ParamError written in the API's field names, e.g. "set speculative=false") reaches the command line as
``--steps: ... use --no-speculative ...``."""
from __future__ import annotations

import json

import pytest

import tiny
from unmask.cli.main import main
from unmask.engine.checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m = tiny.loaded()
    d = tmp_path_factory.mktemp("gen") / "ckpt"
    write_checkpoint(d, m.model, m.tokenizer, m.dllm)
    return str(d)


def _generate(ckpt, *extra):
    return main(["generate", ckpt, "--prompt", "Hello", "--max-tokens", "4", "--json", "--weights", "native",
                 *extra])


@pytest.mark.parametrize("option", [["--steps", "4"], ["--threshold", "0.9"], ["--remasking", "margin"]])
def test_a_diffusion_option_with_speculative_names_the_cli_flags(ckpt, capsys, option):
    """--speculative with --steps / --threshold / another --remasking: exit 2, one line naming the option and the
    command's own way out (--no-speculative), not the API's (speculative=false)."""
    assert _generate(ckpt, "--speculative", *option) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"unmask generate: error: {option[0]}: has no effect with speculative decoding"), err
    assert "use --no-speculative" in err and "speculative=false" not in err, err
    assert _generate(ckpt, "--no-speculative", "--temperature", "0", *option) == 0  # the way out works
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) >= 1


def test_other_engine_rules_name_the_cli_flags_too(ckpt, capsys):
    """Multi-word fields in a reason are the command's options (--speculative-epsilon, --block-size)."""
    assert _generate(ckpt, "--speculative", "--speculative-branches", "3", "--block-size", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask generate: error: --speculative-branches: must be <= --block-size - 1 (1)"), err
    assert _generate(ckpt, "--speculative", "--temperature", "0.5", "--speculative-epsilon", "0.1") == 2
    err = capsys.readouterr().err
    assert "--speculative-epsilon: relaxed acceptance" in err and "temperature 0" in err, err


def test_listed_one_word_fields_name_the_cli_flags():
    """A checkpoint that decodes speculatively by default, --steps with --speculative-branches: the reason lists
    the conflicting fields, and one-word ones there are flags too ("drop --steps", not "drop steps")."""
    import argparse

    from unmask.cli.generate import _in_flags
    from unmask.engine import ParamError, SamplingParams
    from unmask.engine.plan import resolve_params

    with pytest.raises(ParamError) as e:
        resolve_params(SamplingParams.from_flat(steps=4, speculative_branches=1, max_tokens=8), {"speculative": True}, 4)
    args = argparse.Namespace(steps=4, speculative_branches=1, threshold=None, temperature=None)
    msg = _in_flags(e.value, args)
    assert msg.startswith("--speculative-branches: only applies with self-speculative decoding"), msg
    assert "also sets --steps" in msg and "drop --speculative-branches, or drop --steps to get" in msg, msg


def test_show_steps_drops_the_canvas_after_an_early_eos(capsys):
    """The last ``--show-steps`` line of a finished answer has no placeholders after its last revealed token: nothing
    decodes them after an EOS (a masked position inside stays ``_``)."""
    from types import SimpleNamespace

    from unmask.cli.generate import _StepView

    view = _StepView(lambda t: f"<{t}>", block_size=4)

    def ev(canvas, finished):
        return SimpleNamespace(canvas=canvas, block=0, step=0, nfe=1, revealed=[], finished=finished, num_tokens=2)

    view.update(ev([None, 5, None, 2, None, None], finished=False))
    view.update(ev([None, 5, None, 2, None, None], finished=True))
    view.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].endswith("] _<5>_<2>__") and lines[1].endswith("] _<5>_<2>"), lines


def test_text_options_that_are_not_utf8_are_one_line():
    """The shell passes other bytes as surrogate escapes (break-it: a traceback from the tokenizer); checked before
    any model loads, so the checkpoint need not exist."""
    import os
    import subprocess
    import sys

    for args, option in (([b"--prompt", b"\xff\xfe bad"], "--prompt"), ([b"--prompt", b"ok", b"--suffix", b"a\xc3"],
                                                                             "--suffix"),
                         ([b"--prompt", b"ok", b"--stop", b"\x80"], "--stop")):
        r = subprocess.run([os.fsencode(sys.executable), b"-m", b"unmask.cli.main", b"generate", b"/nonexistent",
                            *args], capture_output=True, timeout=60)
        err = r.stderr.decode("utf-8", "replace").strip()
        assert r.returncode == 2 and "\n" not in err and option in err and "not UTF-8" in err, err


def test_model_independent_rules_come_before_the_load(capsys):
    from unmask.cli.main import main

    assert main(["generate", "/nonexistent", "--prompt", ""]) == 2
    assert "--prompt: empty" in capsys.readouterr().err
    assert main(["generate", "/nonexistent", "--prompt", "x", "--speculative", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--steps: has no effect with speculative decoding" in err and "/nonexistent" not in err, err
