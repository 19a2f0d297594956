"""``unmask generate [MODEL] --prompt TEXT``: one generation from the command line (no MODEL: the model ``unmask
serve`` serves by default)."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time

from unmask.engine.limits import REMASKING_STRATEGIES

NEGATABLE = ("speculative",)  # the boolean options that also have a --no-NAME form


def register(sub, name):
    """Add the ``unmask generate`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="generate text with a diffusion LM",
                       description="Generate with block-wise iterative unmasking.")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (or hub id); default: the model `unmask serve` serves by default (the "
                        "trained SmolLM2 A2D if the recipe made one, else the SmolLM2 conversion + the shipped mask-row adapter)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=None,
                   help="total denoising steps (default: one token per step, or the checkpoint's default threshold "
                        "when it has one)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--remasking", default=None,
                   help=" | ".join(REMASKING_STRATEGIES) + " (default: the checkpoint's for plain diffusion, else "
                        "low_confidence)")
    p.add_argument("--threshold", type=float, default=None, help="confidence-threshold parallel decoding")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the checkpoint's default temperature (else 1.0, or 0 when speculative)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--suffix", default=None, help="text after the generated region (infilling)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable, at most 4)")
    p.add_argument("--ignore-eos", action="store_true", help="EOS does not end generation (vLLM's ignore_eos)")
    p.add_argument("--cache", default="auto", help="auto | none | prefix | dual")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                   help="self-speculative decoding: mask-block drafts verified by the model's causal path (greedy: "
                        "output identical to --block-size 1 greedy decoding; --temperature > 0: speculative "
                        "sampling; prefix_causal models; default: the checkpoint's default)")
    p.add_argument("--speculative-branches", type=int, default=None,
                   help="fallback draft groups per step (default: min(3, block size - 1))")
    p.add_argument("--speculative-epsilon", type=float, default=None,
                   help="accept drafts by Medusa's typical acceptance with this epsilon (lossy; default: exact)")
    p.add_argument("--speculative-ratio", type=float, default=None,
                   help="also accept drafts whose probability is >= this ratio x the top token's (lossy; default: "
                        "exact)")
    p.add_argument("--speculative-no-repeat-ngram", type=int, default=None,
                   help="loop guard of the relaxed rules: a draft kept only by --speculative-epsilon/-ratio must not "
                        "complete an n-gram of this many tokens already generated (default 3; 0 = off)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default: torch's choice; 1 is often fastest on a busy CPU)")
    p.add_argument("--family", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto", choices=["auto", "native", "fp16", "int8", "int4"],
                   help="how the linear layers run: auto = fbgemm-packed fp16 on a CPU (int4 for weights on a "
                        "4-bit grid, as a Q4 GGUF's), as loaded elsewhere")
    p.add_argument("--show-steps", action="store_true",
                   help="show the canvas after every step on stderr: redrawn in place on a terminal, one line per "
                        "step when piped (masks as _)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    """Generate one completion (a thin wrapper of :meth:`unmask.engine.LLM.stream`) and print its text, or with
    ``--json`` one JSON object (``seconds``: wall clock of the decoding); returns 0. ``--temperature`` unset = the
    checkpoint's default (``unmask.engine.plan``).

    Raises:
        UsageError: bad sampling option (named ``--option``), unloadable checkpoint or bad prompt.
    """
    from unmask.cli.main import UsageError
    from unmask.engine import CheckpointError, ParamError, SamplingParams

    try:
        params = SamplingParams.from_flat(max_tokens=args.max_tokens, steps=args.steps, block_size=args.block_size,
                                remasking=args.remasking, threshold=args.threshold, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, cfg_scale=args.cfg_scale, seed=args.seed,
                                suffix=args.suffix, stop=args.stop, cache=args.cache, ignore_eos=args.ignore_eos,
                                speculative=args.speculative,
                                speculative_branches=args.speculative_branches,
                                speculative_epsilon=args.speculative_epsilon,
                                speculative_ratio=args.speculative_ratio,
                                speculative_no_repeat_ngram=args.speculative_no_repeat_ngram)
        if params.speculative:  # rules that need no model: before the seconds of loading one
            from unmask.engine.plan import check_no_unused_fields

            check_no_unused_fields(params)
    except ParamError as exc:
        raise UsageError(_in_flags(exc, args)) from exc
    for name in ("prompt", "suffix"):
        _check_text(f"--{name}", getattr(args, name))
    for text in args.stop or []:
        _check_text("--stop", text)
    if not args.prompt and not args.chat:  # as the engine would say after the model's load
        raise UsageError("--prompt: empty: give the text to continue (with --chat an empty message is a prompt)")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads: must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        from unmask.cli.serve import default_model

        args.model, default_block, what = default_model()
        if args.block_size is None and default_block is not None:
            params.block_size = default_block
        print(f"[unmask] no MODEL given: generating with {what}", file=sys.stderr, flush=True)
    from unmask.engine import LLM, TokenTexts

    try:
        llm = LLM(args.model, family=args.family, device=args.device, dtype=args.dtype, max_batch_size=1,
                  weights=args.weights)
        prompt_ids = (llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                      else llm.encode(args.prompt))
        texts = TokenTexts(llm.tokenizer)
        out = None
        show = _StepView(texts, params.block_size) if args.show_steps else None
        t0 = time.perf_counter()
        try:
            for ev in llm.stream(prompt_ids, params, request_id="cli"):
                if show is not None:
                    show.update(ev)
                out = ev.output or out
        finally:
            if show is not None:
                show.close()
    except ParamError as exc:  # a rule between options (e.g. a relaxed rule with a temperature): name the option
        raise UsageError(_in_flags(exc, args)) from exc
    except (CheckpointError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "steps": out.steps, "nfe": out.nfe, "seconds": round(seconds, 4),
                          "tokens_per_second": round(len(out.token_ids) / seconds, 3) if seconds else None}))
    else:
        print(out.text)
    return 0


def _check_text(option: str, text: str | None) -> None:
    """Command-line text must be UTF-8: the shell hands other bytes to Python as surrogate escapes, which the
    tokenizer cannot take (break-it: ``--prompt $'\\xff'`` ended in a traceback).

    Raises:
        UsageError: naming the option and the first byte that is not UTF-8.
    """
    from unmask.cli.main import UsageError

    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
        raise UsageError(f"{option}: not UTF-8 text ({what} at position {exc.start}); "
                         f"pass the text in UTF-8") from None


def _in_flags(exc, args: argparse.Namespace) -> str:
    """A :class:`ParamError`'s message in this command's options instead of the API's field names: the field as
    ``--field-name``; in the reason ``set speculative=false`` as ``use --no-speculative`` (``=true``:
    ``--speculative``) and every multi-word field this command has an option for (``speculative_epsilon``,
    ``block_size``) as that option. One-word names stay as they are: they are also words (``temperature 0``)."""
    options = {name for name in vars(args) if not name.startswith("_")}

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def assignment(m: re.Match) -> str:  # "set speculative=false" -> "use --no-speculative"
        verb, name, value = m.group(1), m.group(2), m.group(3)
        if name not in options or (value == "false" and name not in NEGATABLE):
            return m.group(0)
        return ("use " if verb else "") + flag(name if value == "true" else f"no_{name}")

    reason = re.sub(r"\b(set )?([a-z_]+)=(true|false)\b", assignment, exc.reason)
    reason = re.sub(r"(?<![-\w])([a-z]+(?:_[a-z]+)+)\b",
                    lambda m: flag(m.group(1)) if m.group(1) in options else m.group(0), reason)
    # one-word names where the reason lists fields ("also sets steps, threshold", "drop steps and threshold")
    reason = re.sub(r"\b(sets|drop|and|,) ([a-z]+)\b",
                    lambda m: f"{m.group(1)} {flag(m.group(2))}" if m.group(2) in options else m.group(0), reason)
    return f"{flag(exc.field)}: {reason}"


class _StepView:
    """``--show-steps``: on a terminal (stderr) the canvas is redrawn in place after every step with rich's
    ``Live`` (the same view as ``unmask chat``: masks as placeholders, tokens coloured by their reveal step, the
    current block marked, a status line); piped, one line per step (``[block B step S nfe N] canvas``, masks as
    ``_``)."""

    def __init__(self, texts, block_size: int | None):
        from unmask.clients.stream import Canvas

        self.texts = texts
        self.canvas = Canvas(block_size=block_size)
        self.live = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), auto_refresh=False, transient=False)
            self.live.start()

    def update(self, ev) -> None:
        self.canvas.update({"canvas": [None if t is None else self.texts(t) for t in ev.canvas], "step": ev.step,
                            "block": ev.block, "nfe": ev.nfe,
                            "revealed": [{"position": r.position} for r in ev.revealed]})
        if ev.finished:  # the last event: after an early EOS nothing decodes the rest of the canvas
            self.canvas.drop_unrevealed_tail()
        if self.live is None:
            canvas = "".join("_" if c is None else c for c in self.canvas.cells)
            print(f"[block {ev.block} step {ev.step} nfe {ev.nfe}] {canvas}", file=sys.stderr, flush=True)
            return
        from rich.console import Group
        from rich.text import Text

        from unmask.clients.chat import render_canvas

        tpf = ev.num_tokens / ev.nfe if ev.nfe else 0.0
        status = Text(f"block {ev.block}  step {ev.step}  NFE {ev.nfe}  tokens {ev.num_tokens}  TPF {tpf:.2f}",
                      style="grey62")
        self.live.update(Group(render_canvas(self.canvas), status), refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
