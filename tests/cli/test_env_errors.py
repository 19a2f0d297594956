"""An ``unmask serve`` option's error names where its value came from: ``$UNMASK_<OPTION>`` when from the
environment, the flag when from the command line (new-user report: ``UNMASK_PREFILL_CHUNK=-3 unmask serve`` was
refused naming ``--prefill-chunk``, a flag nobody typed). Every check of ``cli/serve.py: run`` and the model
loader's option errors (``device: ...``, ``device_map: ...``) go through ``option_name``."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from unmask.cli.main import main
from unmask.cli.serve import LOAD_OPTIONS

SERVE_PY = Path(__file__).resolve().parents[2] / "cli" / "serve.py"

# (option dest, bad value, what the error says): refused before any model is loaded
BEFORE_LOAD = [
    ("prefill_chunk", "-3", "must be >= 0"),
    ("max_batch_size", "0", "must be >= 1"),
    ("max_queue", "0", "must be >= 1"),
    ("default_max_tokens", "0", "must be >= 1"),
    ("max_seqs_per_request", "0", "must be >= 1"),
    ("max_model_len", "0", "must be >= 1"),
    ("max_cached_tokens", "-5", "must be >= 1"),
    ("block_size", "0", "must be >= 1"),
    ("threads", "0", "must be >= 1"),
    ("request_timeout", "0", "must be > 0 seconds"),
    ("port", "70000", "must be in 0..65535"),
    ("chat_template", "/nonexistent/template.jinja", "cannot read"),
    ("api_key_file", "/nonexistent/key", "cannot read"),
]


def _var(dest: str) -> str:
    return "UNMASK_" + dest.upper()


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _serve(argv, monkeypatch, capsys, env=None) -> str:
    if "UNMASK_PORT" not in (env or {}) and not any(a.startswith("--port") for a in argv):
        monkeypatch.setenv("UNMASK_PORT", "0")  # any free port: a server left on :8000 must not answer first
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *argv]) == 2
    return "\n".join(line for line in capsys.readouterr().err.splitlines() if "error:" in line)  # not the log


@pytest.mark.parametrize("dest, value, says", BEFORE_LOAD, ids=[d for d, _, _ in BEFORE_LOAD])
def test_a_bad_value_from_the_environment_names_the_variable(monkeypatch, capsys, dest, value, says):
    err = _serve(["/nonexistent"], monkeypatch, capsys, {_var(dest): value})
    assert f"${_var(dest)}: " in err and says in err, err
    assert _flag(dest) not in err, err  # not blamed on a flag nobody typed


@pytest.mark.parametrize("dest, value, says", BEFORE_LOAD, ids=[d for d, _, _ in BEFORE_LOAD])
def test_a_bad_value_from_the_command_line_names_the_flag(monkeypatch, capsys, dest, value, says):
    err = _serve(["/nonexistent", f"{_flag(dest)}={value}"], monkeypatch, capsys)
    assert f"{_flag(dest)}: " in err and says in err, err
    assert "$UNMASK_" not in err, err


def test_the_flag_wins_and_is_named_when_both_are_set(monkeypatch, capsys):
    """A good variable overridden by a bad flag names the flag; a bad variable beside another good one names the
    bad variable."""
    err = _serve(["/nonexistent", "--prefill-chunk", "-1"], monkeypatch, capsys, {"UNMASK_PREFILL_CHUNK": "64"})
    assert "--prefill-chunk: must be >= 0" in err and "$UNMASK_PREFILL_CHUNK" not in err, err
    err = _serve(["/nonexistent", "--max-queue", "8"], monkeypatch, capsys,
                 {"UNMASK_MAX_QUEUE": "0", "UNMASK_MAX_BATCH_SIZE": "0"})
    assert "$UNMASK_MAX_BATCH_SIZE: must be >= 1" in err and "QUEUE" not in err, err


def test_no_serve_error_hard_codes_a_flag():
    """Every UsageError of cli/serve.py that names an option takes the name from option_name (a new check
    written as f"--x: ..." would blame the flag for a variable's value again)."""
    source = SERVE_PY.read_text()
    assert not re.findall(r'UsageError\(f?"--', source)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import loaded
    from unmask.engine.checkpoint import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    m = loaded(block_size=4)
    write_checkpoint(str(path), m.model, m.tokenizer, m.dllm)
    return str(path)


# (variable settings, the option the error is about, what it says): errors of the model loader and after loading
AT_LOAD = [
    ({"UNMASK_DEVICE": "tpu9"}, "device", "tpu9"),
    ({"UNMASK_DTYPE": "float99"}, "dtype", "'float99' is not one of"),
    ({"UNMASK_DEVICE_MAP": "bogus"}, "device_map", "'bogus' is not one of"),
    ({"UNMASK_DEVICE_MAP": "auto", "UNMASK_MAX_MEMORY": "lots"}, "max_memory", "'lots' is not DEVICE=SIZE"),
    ({"UNMASK_FAMILY": "nope"}, "family", "'nope' is not one of"),
    ({"UNMASK_MAX_MEMORY": "cpu=2GiB"}, "max_memory", "applies only with device_map"),   # was silently ignored
    ({"UNMASK_OFFLOAD_FOLDER": "/tmp/x"}, "offload_folder", "applies only with device_map"),
    ({"UNMASK_MAX_MODEL_LEN": "100000"}, "max_model_len", "exceeds the model's context of 512"),
]


@pytest.mark.parametrize("env, dest, says", AT_LOAD, ids=[d for _, d, _ in AT_LOAD])
def test_load_errors_name_the_variable_or_the_flag(checkpoint, monkeypatch, capsys, env, dest, says):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    err = _serve([checkpoint], monkeypatch, capsys, env)
    assert f"${_var(dest)}: " in err and says in err, err
    flags = []
    for var, value in env.items():
        monkeypatch.delenv(var)
        flags += [f"{_flag(var[len('UNMASK_'):].lower())}={value}"]
    err = _serve([checkpoint, *flags], monkeypatch, capsys)
    assert f"{_flag(dest)}: " in err and says in err and "$UNMASK_" not in err, err


def test_every_load_option_is_a_serve_option():
    """LOAD_OPTIONS (the loader's error prefixes that are renamed) are options of unmask serve, read by the same
    name (a renamed option would leave its errors in the Python API's words)."""
    from unmask.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert all(hasattr(args, dest) for dest in LOAD_OPTIONS)


def test_a_port_in_use_is_refused_before_the_model_loads(monkeypatch, capsys):
    """New-user report: with port 8000 taken, ``unmask serve`` loaded the whole model and only then failed to bind.
    The bind is tried first (exit 2 in one line naming the option, or its variable), and fast."""
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        t0 = time.perf_counter()
        err = _serve(["/nonexistent/model", "--port", port], monkeypatch, capsys)
        assert f"--port: cannot listen on 127.0.0.1:{port}" in err, err
        err = _serve(["/nonexistent/model"], monkeypatch, capsys, {"UNMASK_PORT": port})
        assert f"$UNMASK_PORT: cannot listen on 127.0.0.1:{port}" in err, err
        assert time.perf_counter() - t0 < 5
    # a nonzero port (port 0 is never checked); the host is resolved before any bind
    err = _serve(["/nonexistent/model", "--host", "no-such-host.invalid", "--port", "8123"], monkeypatch, capsys)
    assert "--host: cannot resolve 'no-such-host.invalid'" in err, err
