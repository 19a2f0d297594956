"""The denoising client, `unmask chat` piped, the retry without include_denoising, one-line errors, the page."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rich.console import Console

from unmask.clients.chat import Chat, render_canvas
from unmask.clients.stream import Canvas, Client, ClientError, Delta, Notice, Step, Usage, printable, resolve_api_key
from unmask.server.visualizer import mount_visualizer

from .conftest import free_port

CHAT = [sys.executable, "-m", "unmask.cli.main", "chat"]


def test_canvas_and_render():
    c = Canvas(block_size=2)
    c.update({"step": 0, "block": 0, "nfe": 2, "revealed": [{"position": 1}], "canvas": [None, "b", None, None]})
    c.update({"step": 1, "block": 0, "nfe": 3, "revealed": [{"position": 0}], "canvas": ["a", "b", None, None]})
    c.update({"step": 2, "block": 1, "nfe": 4, "revealed": [{"position": 3}], "canvas": ["a", "b", None, "d"]})
    assert c.step_of == [1, 0, None, 2] and c.block_of == [0, 0, None, 1]
    assert c.block_span() == (2, 4) and c.revealed == 3
    text = render_canvas(c).plain
    assert text == "ab│·d", text
    assert "NFE 4" in c.status() and "TPF 0.75" in c.status()
    assert c.status().startswith("step 3  block 2  "), c.status()  # both counted from 1 (step 2 of block 1, 0-based)


def test_a_revisable_canvas_shows_edits_and_marks_provisional_tokens():
    """Token editing: a chunk's ``final`` says where the provisional region starts; the canvas takes each chunk's
    tokens as the truth (an edited position shows its new token) and the terminal view shows provisional tokens
    apart (italic)."""
    c = Canvas(block_size=2)
    c.update({"step": 0, "block": 0, "nfe": 1, "revealed": [{"position": 0}], "canvas": ["a", None, None, None],
              "final": 0})
    c.update({"step": 1, "block": 0, "nfe": 2, "revealed": [{"position": 0}, {"position": 1}],
              "canvas": ["x", "b", None, None], "final": 0})
    assert c.cells[:2] == ["x", "b"] and c.provisional(0) and c.provisional(1) and not c.provisional(2)
    styles = [span.style for span in render_canvas(c).spans]
    assert all("italic" in str(s) for s in styles[:2]), styles
    c.update({"step": 2, "block": 1, "nfe": 3, "revealed": [{"position": 2}], "canvas": ["x", "b", "c", None],
              "final": 2})
    assert not c.provisional(0) and c.provisional(2)
    c.update({"step": 3, "block": 1, "nfe": 4, "revealed": [{"position": 3}], "canvas": ["x", "b", "c", "d"]})
    assert c.final is None and not any(c.provisional(p) for p in range(4))


def test_the_default_base_url_follows_unmask_port():
    from unmask.cli.chat import default_base_url

    assert default_base_url({}) == "http://127.0.0.1:8000/v1"
    assert default_base_url({"UNMASK_PORT": "9123"}) == "http://127.0.0.1:9123/v1"
    assert default_base_url({"UNMASK_PORT": "9123", "UNMASK_BASE_URL": "http://h:1/v1"}) == "http://h:1/v1"


def test_api_key_sources():
    assert resolve_api_key("a", {"UNMASK_API_KEY": "b"}) == "a"
    assert resolve_api_key(None, {"UNMASK_API_KEY": "b", "OPENAI_API_KEY": "c"}) == "b"
    assert resolve_api_key(None, {"OPENAI_API_KEY": "c"}) == "c"
    assert resolve_api_key(None, {}) is None


def test_client_streams_steps(server):
    client = Client(server["v1"], server["key"])
    events = list(client.chat(server["model"], [{"role": "user", "content": "Hi"}],
                              {"max_tokens": 12, "ignore_eos": True, "block_size": 4}))
    steps = [e for e in events if isinstance(e, Step)]
    text = "".join(e.text for e in events if isinstance(e, Delta))
    assert len(steps) >= 3 and any(isinstance(e, Usage) for e in events)
    c = Canvas()
    for s in steps:
        c.update(s.denoising)
    assert len(c.cells) == 12 and None not in c.cells and c.revealed == 12 and text  # per-token texts may split
    # a multi-byte character, so the joined canvas need not equal the text
    assert any(None in s.denoising["canvas"] for s in steps)   # placeholders before the end


def test_a_finished_canvas_drops_the_positions_after_an_early_eos():
    """After an EOS before max_tokens nothing decodes the rest: the final canvas has no placeholders there (found by
    a new user in the browser page; the terminal views share this Canvas). Masks inside stay."""
    c = Canvas(block_size=4)
    c.update({"canvas": [None, "b", None, "<eos>", None, None, None, None], "step": 0, "block": 0, "nfe": 1,
              "revealed": [{"position": 1}, {"position": 3}]})
    c.drop_unrevealed_tail()
    assert c.cells == [None, "b", None, "<eos>"] and len(c.step_of) == len(c.block_of) == 4
    assert c.block_span() == (0, 4)


def test_retries_once_without_include_denoising():
    bodies = []

    def handler(request: httpx.Request):
        body = json.loads(request.content)
        bodies.append(body)
        if body["stream_options"].get("include_denoising"):  # as OpenAI answers an unknown option
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument supplied: "
                                                                  "stream_options.include_denoising",
                                                       "type": "invalid_request_error"}})
        sse = ('data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
               'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    client = Client("http://example.test/v1", "k", transport=httpx.MockTransport(handler))
    events = list(client.chat("m", [{"role": "user", "content": "x"}]))
    assert len(bodies) == 2 and "include_denoising" not in bodies[1]["stream_options"]
    assert isinstance(events[0], Notice) and "retrying without include_denoising" in events[0].message
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "Hello"
    list(client.chat("m", [{"role": "user", "content": "x"}]))   # remembered: no second rejection
    assert len(bodies) == 3


HOSTILE = "a\x1b[2J\x1b]0;pwned\x07b\rc\x08\x9b31md\x7fe\n\tf é"   # clear, retitle, CR, BS, 8-bit CSI, DEL


def test_printable_neutralises_every_control_character():
    shown = printable(HOSTILE)
    assert shown == "a␛[2J␛]0;pwned␇b␍c␈\\x9b31md␡e\n\tf é", shown
    for c in map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0)]):
        assert c not in printable(f"x{c}y") or c in "\n\t", repr(c)


def _hostile_transport(request: httpx.Request):
    body = json.loads(request.content)
    steps = ""
    if body["stream_options"].get("include_denoising"):
        d = {"index": 0, "step": 0, "block": 0, "nfe": 1, "revealed": [{"position": 0}], "canvas": [HOSTILE]}
        steps = "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "denoising": d}]}) + "\n\n"
    chunk = {"choices": [{"index": 0, "delta": {"content": HOSTILE}, "finish_reason": "stop"}]}
    return httpx.Response(200, text=steps + "data: " + json.dumps(chunk) + "\n\ndata: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("live", [False, True])
def test_model_text_cannot_drive_the_terminal(live, capsys):
    """A random or hostile model emits ESC, BEL, CR, the 8-bit CSI: the chat shows them, the terminal never gets
    them (CI once failed on a tiny model's piped answer holding ``\\x1b``), and the conversation keeps the text."""
    import io

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=200)
    chat = Chat(Client("http://example.test/v1", "k", transport=httpx.MockTransport(_hostile_transport)), "m", {},
                console=console, live=live, out=out)
    assert chat.ask("hi") == HOSTILE and chat.messages[-1]["content"] == HOSTILE
    written = out.getvalue() + capsys.readouterr().err
    assert "␛[2J" in written and "pwned" in written
    # the console itself emits cursor moves when live; none may come from the model's text
    assert "\x1b[2J" not in written and "\x1b]0;" not in written and "\x07" not in written and "\x9b" not in written


def test_server_error_is_one_line():
    client = Client("http://example.test", None, transport=httpx.MockTransport(
        lambda r: httpx.Response(500, json={"error": {"message": "boom"}})))
    with pytest.raises(ClientError, match=r"^server error 500: boom$"):
        list(client.chat("m", []))


def _chat(args, stdin="", env=None, timeout=120):
    return subprocess.run(CHAT + args, input=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_unreachable_and_wrong_key_are_one_line(server):
    r = _chat(["--base-url", f"http://127.0.0.1:{free_port()}/v1"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "cannot reach the server" in r.stderr, r.stderr
    r = _chat(["--base-url", server["v1"], "--api-key", "wrong"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "refused the API key (401)" in r.stderr, r.stderr


def test_piped_chat_is_plain_text(server):
    r = _chat(["--base-url", server["url"], "--max-tokens", "8", "--set", "ignore_eos=true", "--block-size", "4"],
              stdin="Hello\n/steps 4\nAgain\n", env={"UNMASK_API_KEY": server["key"]})
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.count("\n") >= 2 and r.stdout.strip(), r.stdout  # two answers
    assert "\x1b" not in r.stdout and "·" not in r.stdout   # no escape sequences (the model's shown as ␛), no canvas
    assert r.stderr.count("usage:") == 2 and "steps = 4" in r.stderr, r.stderr


def test_page_served_at_root(server):
    page = httpx.get(server["url"] + "/")
    assert page.status_code == 200 and '<base href="/">' in page.text
    assert 'src="visualizer/app.js"' in page.text and 'href="visualizer/style.css"' in page.text
    js = httpx.get(server["url"] + "/visualizer/app.js")
    assert js.status_code == 200 and "include_denoising" in js.text and "javascript" in js.headers["content-type"]
    assert httpx.get(server["url"] + "/visualizer/nope.js").status_code == 404
    assert httpx.get(server["url"] + "/v1/models").status_code == 401   # the page needs no key; /v1 still does
    assert '"/v1/' not in js.text and "fetch(\"/" not in js.text        # relative URLs only


def test_page_under_a_root_path():
    app = FastAPI()
    mount_visualizer(app)
    with TestClient(app, root_path="/unmask") as c:
        assert '<base href="/unmask/">' in c.get("/").text
    fixed = FastAPI()
    mount_visualizer(fixed, "/proxy/")
    with TestClient(fixed) as c:
        assert '<base href="/proxy/">' in c.get("/").text


def test_serve_has_root_path_flag():
    from unmask.cli.main import build_parser

    args = build_parser().parse_args(["serve", "m", "--root-path", "/unmask"])
    assert args.root_path == "/unmask"


def test_bad_knobs_are_refused_locally_once(capsys):
    """A knob out of unmask's range is refused when set (the server's own check), not sent with every later question
    to fail each one (break-it: /steps -3, /block 0, /threshold 2 were accepted); a value of the wrong kind says what
    was expected; fields unmask does not know go to the server as they are."""
    chat = Chat(Client("http://example.test/v1", "k"), "m", {}, live=False)
    for line, says in (("/steps -3", "/steps: must be >= 1, got -3; not set"), ("/block 0", "/block: must be >= 1"),
                       ("/threshold 2", "/threshold: must be <= 1"), ("/steps abc", "expected an integer, got 'abc'"),
                       ("/speculative maybe", "expected on or off"), ("/set top_p 0", "/set top_p: must be > 0")):
        assert chat.command(line)
        assert says in capsys.readouterr().err
    assert chat.options == {}
    # objects go to the server as they are (JSON keys are strings: the HTTP layer converts them), and a rule between
    # fields is the server's to judge (min_tokens <= this chat's max_tokens, not the default 256); break-it
    for line in ("/steps 8", "/threshold off", "/set vendor_field 1", "/set seed 3", '/set logit_bias {"5": 10}',
                 "/max 512", "/set min_tokens 300"):
        chat.command(line)
    assert chat.options == {"steps": 8, "threshold": None, "vendor_field": 1, "seed": 3, "logit_bias": {"5": 10},
                            "max_tokens": 512, "min_tokens": 300}


def test_bad_flags_exit_2_before_connecting():
    for args, says in ((["--steps", "-3"], "--steps: must be >= 1"), (["--set", "top_k=-5"], "--set top_k: must be"),
                       (["--threshold", "1.5"], "--threshold: must be <= 1")):
        r = _chat(["--base-url", "http://127.0.0.1:9/v1", *args])
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_piped_chat_whose_answers_failed_exits_1(server):
    r = _chat(["--base-url", server["v1"], "--set", "vendor_field=1"], stdin="Hello\n",
              env={"UNMASK_API_KEY": server["key"]})
    assert r.returncode == 1 and "error:" in r.stderr and "vendor_field" in r.stderr, (r.returncode, r.stderr)
