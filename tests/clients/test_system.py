"""System tests (`pytest -m system`): the terminal chat under tmux, the page in headless Chromium, the wheel's
package data. Under CI=true a missing tmux / chromium is a failure."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import install_wheel, require, running

pytestmark = pytest.mark.system
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _wait(cond, timeout: float, what: str, every: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class Tmux:
    def __init__(self, tmux: str, name: str, command: str):
        self.tmux, self.sock = tmux, name
        subprocess.run([tmux, "-L", name, "new-session", "-d", "-x", "110", "-y", "45", command], check=True)

    def send(self, *keys: str) -> None:
        subprocess.run([self.tmux, "-L", self.sock, "send-keys", *keys], check=True)

    def screen(self) -> str:
        return subprocess.run([self.tmux, "-L", self.sock, "capture-pane", "-p"], capture_output=True,
                              text=True).stdout

    def status_screens_until(self, marker: str, timeout: float, what: str, every: float) -> list[str]:
        """Poll the screen every ``every`` s until it shows ``marker``; the screens seen that show the status line
        (``NFE``), oldest first."""
        screens = []

        def reached():
            s = self.screen()
            if "NFE" in s:
                screens.append(s)
            return marker in s
        _wait(reached, timeout, what, every=every)
        return screens

    def kill(self) -> None:
        subprocess.run([self.tmux, "-L", self.sock, "kill-server"], capture_output=True)


def test_terminal_chat_under_tmux(server, tmp_path):
    tmux = require("tmux")
    cmd = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "unmask.cli.main", "chat", "--base-url", server["v1"], "--api-key", server["key"],
        "--max-tokens", "160", "--block-size", "8", "--set", "ignore_eos=true", "--set", 'cache="none"'])
    t = Tmux(tmux, f"unmask-test-{os.getpid()}", f"TERM=xterm-256color COLUMNS=110 {cmd}")
    try:
        _wait(lambda: "you>" in t.screen(), 60, "the prompt")
        t.send("Hello there", "Enter")
        screens = t.status_screens_until("usage:", 90, "the answer", every=0.02)
        masked = [s.count("·") for s in screens]
        assert max(masked) > 20 and masked[-1] < max(masked), masked   # placeholders turned into text
        assert any(0 < s.count("·") for s in screens) and "TPF" in screens[-1] and "tok/s" in screens[-1]
        final = t.screen()
        assert "usage:" in final and "completion tokens" in final
        (tmp_path / "screens.txt").write_text("\n=====\n".join(screens[:: max(1, len(screens) // 10)]))

        # Ctrl-C stops the answer, the slot is freed, the chat goes on
        t.send("/reset", "Enter")
        t.send("/max 400", "Enter")
        t.send("A long one", "Enter")
        try:
            _wait(lambda: running(server["url"]) >= 1, 30, "the request to run")
        except AssertionError:
            raise AssertionError(t.screen()) from None
        time.sleep(0.3)
        t.send("C-c")
        _wait(lambda: "(stopped)" in t.screen(), 20, "(stopped)")
        _wait(lambda: running(server["url"]) == 0, 20, "the running gauge to return to 0")
        t.send("/max 8", "Enter")
        t.send("Short one", "Enter")
        _wait(lambda: t.screen().count("usage:") >= 2, 60, "the next answer")
        t.send("C-d")
    finally:
        t.kill()


def test_browser_end_to_end(server, tmp_path):
    chromium = require("chromium")
    sync_api = pytest.importorskip("playwright.sync_api") if os.environ.get("CI") != "true" else \
        __import__("playwright.sync_api", fromlist=["sync_playwright"])
    shots = Path(os.environ.get("UNMASK_SCREENSHOTS", tmp_path))
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=chromium,
                                                   headless=True, args=CHROMIUM_FLAGS,
                                                   viewport={"width": 1100, "height": 640})
        try:
            page = ctx.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server["url"] + "/")
            _wait(lambda: "API key" in page.inner_text("#error"), 20, "the API-key error")
            assert page.is_visible("#keybox")  # shown because this server needs a key
            assert "left_to_right" in page.inner_text("#remasking")
            page.fill("#apikey", server["key"])
            page.dispatch_event("#apikey", "change")
            page.wait_for_selector("#model option", state="attached", timeout=20000)
            assert page.input_value("#model") == server["model"]
            page.fill("#max_tokens", "40")
            page.fill("#block_size", "8")
            page.fill("#steps", "20")
            page.fill("#extra", '{"ignore_eos": true, "seed": 3}')
            page.fill("#prompt", "Name three colours.")
            page.click("#send")
            page.wait_for_selector("body[data-done='1']", timeout=60000)
            assert page.inner_text("#error") == "" or not page.is_visible("#error"), page.inner_text("#error")
            assert page.locator("#canvas .mask").count() == 0 and page.locator("#canvas .tok").count() > 0
            assert "NFE" in page.inner_text("#counters") and "usage:" in page.inner_text("#counters")
            steps = int(page.get_attribute("#slider", "max")) + 1
            assert steps >= 5, steps
            assert page.locator("#canvas .bound").count() >= 1
            page.screenshot(path=str(shots / "visualizer.png"))
            page.eval_on_selector("#slider", "e => { e.value = 0; e.dispatchEvent(new Event('input')); }")
            assert page.locator("#canvas .mask").count() > 30           # step 1: nearly all masked
            assert page.inner_text("#slider-label") == f"step 1 of {steps}"
            mid = steps // 2
            page.eval_on_selector("#slider", f"e => {{ e.value = {mid}; e.dispatchEvent(new Event('input')); }}")
            assert 0 < page.locator("#canvas .mask").count() < 40
            assert page.inner_text("#slider-label") == f"step {mid + 1} of {steps}"
            # an early EOS (forced by logit_bias): the finished canvas shows no placeholders for the positions after
            # it, which nothing decodes (found by a new user: they stayed as masks)
            from tiny import make_tokenizer

            eos = make_tokenizer().convert_tokens_to_ids("<|im_end|>")
            page.fill("#extra", '{"seed": 3, "logit_bias": {"%d": 100}}' % eos)
            page.fill("#prompt", "Stop at once.")
            page.click("#send")
            page.wait_for_selector("body[data-done='2']", timeout=60000)
            assert page.inner_text("#error") == "" or not page.is_visible("#error"), page.inner_text("#error")
            assert page.locator("#canvas .mask").count() == 0, page.inner_html("#canvas")
            assert 0 < page.locator("#canvas .tok").count() < 40
            # the legend's swatches are the canvas's colours: a token's colour is the swatch of its step
            swatches = page.eval_on_selector_all("#swatches span",
                                                 "s => s.map(e => getComputedStyle(e).backgroundColor)")
            assert len(swatches) == 12 and len(set(swatches)) == 12
            for tok in page.query_selector_all("#canvas .tok")[:5]:
                step = int(tok.get_attribute("title").split("revealed at step ")[1].split(" ")[0])
                assert tok.evaluate("e => getComputedStyle(e).color") == swatches[(step - 1) % 12]
            assert page.inner_text("#c-step").startswith("step ") and "block 1" in page.inner_text("#c-step")
            # a refused request is a failure, not "(stopped)"
            page.fill("#extra", '{"top_k": "many"}')
            page.fill("#prompt", "Refused.")
            page.click("#send")
            page.wait_for_selector("body[data-done='3']", timeout=60000)
            last = page.locator("#history .assistant").last.inner_text()
            assert "(failed" in last and "(stopped)" not in last and "top_k" in page.inner_text("#error"), last
            # New chat clears the conversation and the old canvas
            page.click("#clear")
            assert page.locator("#history .msg").count() == 0 and page.locator("#canvas span").count() == 0
            assert page.is_disabled("#slider") and page.inner_text("#slider-label") == "no answer yet"
            # a server without a key: the field stays hidden
            page.route("**/v1/models", lambda route: route.fulfill(
                status=200, content_type="application/json",
                body='{"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0}]}'))
            page.reload()
            page.wait_for_selector("#model option", state="attached", timeout=20000)
            assert not page.is_visible("#keybox")
            assert not errors, errors
        finally:
            ctx.close()
    assert (shots / "visualizer.png").stat().st_size > 5000


def test_wheel_ships_the_page(tmp_path):
    py, site, _ = install_wheel(tmp_path)
    import fastapi

    deps = str(Path(fastapi.__file__).resolve().parents[1])
    check = ("import sys; sys.path.append(%r)\n"
             "import unmask.server.visualizer as v, fastapi\n"
             "from fastapi.testclient import TestClient\n"
             "assert v.__file__.startswith(%r), v.__file__\n"
             "app = fastapi.FastAPI(); v.mount_visualizer(app); c = TestClient(app)\n"
             "r = c.get('/'); assert r.status_code == 200 and 'visualizer/app.js' in r.text\n"
             "assert 'include_denoising' in c.get('/visualizer/app.js').text\n"
             "assert c.get('/visualizer/style.css').status_code == 200\n"
             "print('ok')") % (deps, site)
    r = subprocess.run([str(py), "-I", "-c", check], capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
    assert r.stdout.strip() == "ok", r.stdout + r.stderr


def test_generate_show_steps_redraws_in_place_under_tmux(tmp_path):
    """`unmask generate --show-steps` on a terminal redraws one canvas (placeholders turning into text, a status
    line) instead of printing a line per step; piped, it keeps one line per step."""
    tmux = require("tmux")
    from .conftest import TESTS

    ckpt = tmp_path / "tiny-a2d"
    subprocess.run([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); from tiny import loaded; "
        "from unmask.engine.checkpoint import write_checkpoint; m = loaded(block_size=4); "
        f"write_checkpoint({str(ckpt)!r}, m.model, m.tokenizer, m.dllm)")], check=True)
    args = [sys.executable, "-m", "unmask.cli.main", "generate", str(ckpt), "--prompt", "Hello", "--max-tokens", "48",
            "--block-size", "8", "--temperature", "0", "--ignore-eos", "--threads", "1", "--show-steps"]
    piped = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    step_lines = [line for line in piped.stderr.splitlines() if line.startswith("[block ")]
    assert len(step_lines) >= 6 and "_" in step_lines[0]

    cmd = " ".join(shlex.quote(a) for a in args) + "; echo GEN-EXITED; sleep 30"
    t = Tmux(tmux, f"unmask-gen-{os.getpid()}", f"TERM=xterm-256color COLUMNS=110 {cmd}")
    try:
        screens = t.status_screens_until("GEN-EXITED", 120, "the generation", every=0.01)
        final = t.screen()
        assert final.count("NFE") == 1 and "tokens 48" in final, final   # one status line: redrawn, not appended
        assert "[block " not in final                   # not the piped line-per-step output
        masked = [s.count("·") for s in screens]
        assert max(masked) > 0 and masked[-1] == 0, masked   # placeholders turned into text
    finally:
        t.kill()
