"""Tensor parallelism = a single process (system; docs/design.md#scale-out, ``unmask.engine.tensor_parallel``).

``unmask serve --tensor-parallel-size 2`` (2 processes, gloo on the CPU, native weights) against the plain
``unmask serve --weights native`` of the same checkpoint, for a tiny a2d, LLaDA and Dream model: greedy answers to
concurrent requests (continuous batching), a prompt long enough for several prefill chunks, and a second chat turn
that loads the first's KV from the prefix cache (a2d: 16+ cached tokens) are the same text. Killing rank 1
mid-stream ends the stream with an error event and ``[DONE]`` and the server exits 1 within the collective
timeout, naming the group; killing rank 0 makes rank 1 exit.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from serving import start_serve, stop_server

pytestmark = pytest.mark.system

TIMEOUT_S = 10
PROMPTS = ["The quick brown fox", "One two three four five six seven", "What is the capital of France?",
           "Diffusion language models unmask tokens " * 12]  # the last: several prefill chunks of 64 rows


def _families():
    spec = importlib.util.spec_from_file_location("unmask_test_families", Path(__file__).parent / "test_families.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(family: str, out: Path) -> str:
    if family == "a2d":
        from tiny import loaded
        from unmask.engine.checkpoint import write_checkpoint

        m = loaded(block_size=4)
        write_checkpoint(str(out), m.model, m.tokenizer, m.dllm)
    else:
        getattr(_families(), f"_write_{family}")(out)
    return str(out)


def _answers(base: str, model: str) -> dict:
    def one(prompt):
        r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                       "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: one batch, sequences joining and leaving
        texts = list(pool.map(one, PROMPTS))
    chat = [{"role": "user", "content": "Tell me about " + "the lazy dog " * 6}]
    first = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": chat, "max_tokens": 8,
                                                            "temperature": 0}, timeout=120).json()
    chat += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And then?"}]
    second = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": chat, "max_tokens": 8,
                                                             "temperature": 0}, timeout=120).json()
    return {"completions": texts, "turns": [first["choices"][0]["message"]["content"],
                                            second["choices"][0]["message"]["content"]],
            "cached": second["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.mark.parametrize("family", ["a2d", "llada", "dream"])
def test_two_ranks_answer_as_one_process(tmp_path, family):
    ckpt = _write(family, tmp_path / family)
    model = Path(ckpt).name
    common = [ckpt, "--weights", "native", "--threads", "1", "--max-batch-size", "4", "--prefill-chunk", "64"]
    (tmp_path / "one").mkdir()
    (tmp_path / "tp").mkdir()
    plain, base, _ = start_serve(tmp_path / "one", *common)
    try:
        want = _answers(base, model)
    finally:
        stop_server(plain)
    tp, base, log = start_serve(tmp_path / "tp", *common, "--tensor-parallel-size", "2",
                                "--tensor-parallel-timeout", str(TIMEOUT_S))
    try:
        got = _answers(base, model)
    finally:
        stop_server(tp)
    assert got == want, log.read_text()[-2000:]
    assert tp.returncode == 0, log.read_text()[-2000:]
    assert "tensor parallel: 2 ranks (gloo)" in log.read_text()
    if family == "a2d":  # prefix-causal: the second turn loaded the first's KV (on both ranks, each its shard)
        assert got["cached"] >= 16


def _followers(pid: int) -> list[int]:
    """The processes ``pid`` started as tensor-parallel ranks (read from /proc: no procps needed)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"unmask.cli.serve_tp" in cmd:
            out.append(int(stat.parent.name))
    return out


def test_a_killed_rank_ends_the_server_within_the_timeout(tmp_path):
    ckpt = _write("a2d", tmp_path / "a2d")
    proc, base, log = start_serve(tmp_path, ckpt, "--weights", "native", "--threads", "1", "--tensor-parallel-size",
                                  "2", "--tensor-parallel-timeout", str(TIMEOUT_S))
    try:
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = {"model": "a2d", "prompt": "Count", "max_tokens": 400, "temperature": 0, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        followers = _followers(proc.pid)
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGKILL)
        killed = time.time()
        t.join(60)
        assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2]), lines[-3:]
        proc.wait(timeout=TIMEOUT_S + 30)
        assert time.time() - killed < TIMEOUT_S + 30
        assert proc.returncode == 1
        text = log.read_text()
        assert "tensor parallel group failed" in text, text[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()



def test_the_other_ranks_exit_when_rank_0_dies(tmp_path):
    ckpt = _write("a2d", tmp_path / "a2d")
    proc, _, log = start_serve(tmp_path, ckpt, "--weights", "native", "--threads", "1", "--tensor-parallel-size", "2",
                               "--tensor-parallel-timeout", str(TIMEOUT_S))
    followers = _followers(proc.pid)
    assert len(followers) == 1, followers
    os.kill(proc.pid, signal.SIGKILL)  # no goodbye on the channel: the follower sees it close
    proc.wait(10)
    end = time.time() + TIMEOUT_S + 30
    while Path(f"/proc/{followers[0]}").exists() and Path(f"/proc/{followers[0]}/stat").read_text().split()[2] != "Z":
        assert time.time() < end, log.read_text()[-2000:]
        time.sleep(0.2)
    assert "tensor parallel rank 1 stops" in log.read_text()
