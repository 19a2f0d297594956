"""Third-party clients against `unmask serve` (system tests, issue 40): guidellm's streaming benchmark and
lm-evaluation-harness's ``local-completions`` (a generate_until and a multiple-choice task written here, in
tests/clients/lm_eval_tasks, over local JSONL files with the checkpoint's own tokenizer: no downloads), each from
its own virtual environment (tests/client_venvs.py; never unmask's). The multiple-choice accuracy equals the same
task scored with transformers' float32 log-likelihoods of the served checkpoint; on a tiny LLaDA replica the task
runs with the Monte-Carlo estimate, whose mean over seeds lies within its standard error of a many-sample one."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from client_venvs import client_venv
from serving import SERVER_ENV, start_serve, start_server, stop_server

pytestmark = pytest.mark.system
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
OFFLINE = {**SERVER_ENV, "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "DO_NOT_TRACK": "1", "TQDM_DISABLE": "1"}


def _venv(name: str, tmp: Path) -> Path:
    log = tmp / f"pip-{name}.log"
    with open(log, "w") as f:
        try:
            return client_venv(name, log=f)
        except subprocess.CalledProcessError:
            pytest.fail(f"installing {name} failed:\n{log.read_text()[-3000:]}")


def _model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny a2d (prefix-causal, logit shift) checkpoint served out of the box."""
    tmp = tmp_path_factory.mktemp("tiny-serve")
    proc, base, log = start_server(tmp)
    yield base, tmp / "tiny-a2d"
    stop_server(proc)


@pytest.fixture(scope="module")
def tiny_native(tmp_path_factory):
    """The same checkpoint served with its float32 weights as loaded (``--weights native``; the CPU default packs
    them to fp16, which moves log-likelihoods in the third decimal)."""
    tmp = tmp_path_factory.mktemp("tiny-native")
    proc, base, log = start_server(tmp, "--weights", "native")
    yield base, tmp / "tiny-a2d"
    stop_server(proc)


def _run(cmd: list[str], tmp: Path, name: str, cwd: Path | None = None, timeout: float = 600) -> str:
    out = tmp / f"{name}.log"
    with open(out, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, timeout=timeout,
                            env={**os.environ, **OFFLINE}).returncode
    text = out.read_text()
    assert rc == 0, f"{name} exited {rc}:\n{text[-4000:]}"
    return text


def test_guidellm_streaming_run_has_no_failed_requests(tiny, tmp_path):
    base, ckpt = tiny
    venv = _venv("guidellm", tmp_path)
    report = tmp_path / "guidellm.json"
    _run([str(venv / "bin" / "guidellm"), "run",
          "--backend", f"kind=openai_http,target={base},model={_model(base)},stream=true",
          "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
          "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
          "--tokenizer", f"kind=hf_auto,model={ckpt}", "--output", f"kind=json,path={report}",
          "--disable-console-interactive"], tmp_path, "guidellm")
    totals = _request_totals(json.loads(report.read_text()))
    assert totals["successful"] == 16 and totals["errored"] == 0 and totals["incomplete"] == 0, totals


def _request_totals(report: dict) -> dict:
    """successful / errored / incomplete request counts of guidellm's JSON report (its one benchmark)."""
    bench = report["benchmarks"][0]
    totals = bench.get("request_totals") or bench["scheduler_metrics"]["requests_made"]
    return {k: int(totals[k]) for k in ("successful", "errored", "incomplete")}


def _lm_eval(venv: Path, base: str, tokenizer: Path, tasks: str, tmp: Path, name: str) -> dict:
    out = tmp / name
    _run([str(venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args",
          f"model={_model(base)},base_url={base}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
          f"num_concurrent=2,max_retries=1,tokenized_requests=True,max_length=256",
          "--tasks", tasks, "--include_path", str(TASKS), "--output_path", str(out), "--log_samples",
          "--batch_size", "1"], tmp, name, cwd=TASKS)
    results = next(out.rglob("results_*.json"))
    samples = {p.name.split("samples_")[1].rsplit("_", 1)[0]: [json.loads(x) for x in p.read_text().splitlines()]
               for p in out.rglob("samples_*.jsonl")}
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


def _direct_accuracy(ckpt: Path, samples: list[dict]) -> tuple[float, float]:
    """The multiple-choice accuracy from transformers' float32 log-likelihoods of ``ckpt`` (the parent: an a2d
    prefix-causal checkpoint is a causal LM), the pairs tokenised as lm-eval does (context and context +
    continuation, the continuation the difference), and the largest difference from lm-eval's log-likelihoods."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    right, worst = 0, 0.0
    for s in samples:
        scores = []
        args = s["arguments"]  # {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}} per choice i
        for ctx, cont in ((args[f"gen_args_{i}"]["arg_0"], args[f"gen_args_{i}"]["arg_1"]) for i in range(len(args))):
            n = len(ctx) - len(ctx.rstrip())
            ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
            whole = tok(ctx + cont, add_special_tokens=False).input_ids
            ctx_ids = tok(ctx, add_special_tokens=False).input_ids
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            scores.append(sum(lp[i - 1, whole[i]].item() for i in range(len(ctx_ids), len(whole))))
        right += int(max(range(len(scores)), key=scores.__getitem__) == int(s["target"]))
        served = [float(r[0]) for r in s["filtered_resps"]]  # [loglikelihood, is_greedy] per choice
        worst = max([worst] + [abs(a - b) for a, b in zip(served, scores)])
    return right / len(samples), worst


def test_lm_eval_local_completions_scores_both_tasks(tiny_native, tmp_path):
    base, ckpt = tiny_native
    venv = _venv("lm-eval", tmp_path)
    got = _lm_eval(venv, base, ckpt, "unmask_tiny_mc,unmask_tiny_gen", tmp_path, "lm-eval")
    acc = got["results"]["unmask_tiny_mc"]["acc,none"]
    assert 0 <= got["results"]["unmask_tiny_gen"]["exact_match,none"] <= 1
    direct, worst = _direct_accuracy(ckpt, got["samples"]["unmask_tiny_mc"])
    print(f"lm-eval multiple-choice accuracy {acc:.4f}, transformers float32 {direct:.4f}; largest log-likelihood "
          f"difference {worst:.2e}")
    assert round(acc, 2) == round(direct, 2) and worst < 1e-3


def _write_llada(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from test_families import _write_llada as write

    write(out)


def test_lm_eval_multiple_choice_on_a_llada_replica_with_the_monte_carlo_estimate(tmp_path):
    ckpt = tmp_path / "llada"
    _write_llada(ckpt)
    proc, base, _ = start_serve(tmp_path, str(ckpt))
    try:
        venv = _venv("lm-eval", tmp_path)
        got = _lm_eval(venv, base, ckpt, "unmask_tiny_mc", tmp_path, "lm-eval-llada")
        assert 0 <= got["results"]["unmask_tiny_mc"]["acc,none"] <= 1
        ids = httpx.post(f"{base}/tokenize", json={"model": _model(base), "prompt": "The sky on a clear day is blue"},
                         timeout=30).json()["tokens"]

        def estimate(seed: int, samples: int) -> dict:
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": _model(base), "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "seed": seed,
                "prompt_logprobs_samples": samples})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["prompt_log_likelihood"]

        runs = [estimate(seed, 32) for seed in range(8)]
        many = estimate(10_000, 1024)
        assert all(r["method"] == "monte_carlo" and r["stderr"] > 0 for r in runs)
        mean = sum(r["value"] for r in runs) / len(runs)
        sem = math.sqrt(sum(r["stderr"] ** 2 for r in runs)) / len(runs)
        print(f"LLaDA replica: mean of 8 x 32 draws {mean:.3f} +- {sem:.3f}, 1024 draws {many['value']:.3f} "
              f"+- {many['stderr']:.3f}, one run's stderr {runs[0]['stderr']:.3f}")
        assert abs(mean - many["value"]) <= runs[0]["stderr"]
        assert abs(mean - many["value"]) <= 2 * math.hypot(sem, many["stderr"])
    finally:
        stop_server(proc)
