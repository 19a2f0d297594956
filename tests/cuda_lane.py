"""The ``cuda`` lane's checks as plain functions, importable without pytest (``tests/test_cuda_lane.py`` wraps
them; ``benchmarks/gpu_check.py`` calls them on a GPU host that has no pytest). Needs torch and transformers;
llguidance only for the constrained paths, which are reported as skipped without it.

Three kinds of check, on one ``(device, dtype)``:

* **forwards**: one forward of each checkpoint (the adapter's mask rows through the adapter) against the same
  forward on the CPU in float32: logits and their argmax.
* **paths**: every path of :mod:`decoding_paths` decoded on the device, its tokens compared with the same path
  decoded on the CPU in float32 (native weights: the reference of every exactness contract).
* **contracts**: the engine's exactness checks, both sides decoded on the device itself: batch invariance (each
  request alone = in a batch), cache = no cache (prefix-causal exact cache), prefix reuse = fresh prefill,
  chunked prefill = the whole prompt, speculative greedy = block 1, the mask-row adapter's causal rows = its parent's (block 1 and speculative).

What is required (:func:`judge`):

* **float32: equal tokens.** Not because a GPU's float32 is bitwise the CPU's (cuBLAS picks other kernels and
  reduction orders than the CPU's BLAS, by shape too), but because the lane's tiny models are decisive: heads
  scaled up so that a token's logit gap and the confidence gaps the reveal order reads are orders of magnitude
  above float32 rounding (~1e-6 relative). A different token in float32 is a device bug (a wrong mask, a row read
  from the wrong place, a tensor left on another device) or a true near-tie: the check names the first differing
  position. TF32 is turned off while a float32 check runs (``torch.set_float32_matmul_precision("highest")``):
  with it a float32 GEMM rounds its inputs to 10 mantissa bits and is no float32 reference.
  Checked on the CPU: every path decoded in float64 gives the float32 tokens. A forward's logits must be within
  :data:`FP32_LOGIT_TOLERANCE` of the reference (relative to the logits' standard deviation), its argmax equal.
* **bfloat16 (and float16): a bound, not equality.** bf16 keeps 8 mantissa bits: on these tiny models a logit
  moves by ~2% of the logits' spread (CPU bf16 vs fp32: median 0.7 on a spread of 32), so ~7-9% of a forward's
  argmaxes flip, and one flipped token changes the canvas every later step reads. Measured on the CPU in bf16
  against float32: 0.17-1.0 of a path's positions agree (the contracts, both sides bf16, held exactly there).
  So a forward's argmax must agree on >= :data:`HALF_MIN_ARGMAX` of the positions (0.90-0.97 measured) and a path
  or contract on >= :data:`HALF_MIN_AGREEMENT` of its positions: a floor a broken forward (a wrong mask, rows
  read from the wrong place) does not reach, not a measure of quality; the agreement itself is the result.
  Constrained outputs must parse as JSON objects in every dtype. One contract is exact in every dtype
  (:data:`EXACT_IN_EVERY_DTYPE`): the adapter at block 1 = its parent (the same forwards, the causal rows on the
  parent's weights; docs/design.md#exactness-contracts-by-device-and-dtype).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import decoding_paths as dp

FP32_LOGIT_TOLERANCE = 1e-3  # max |logit - reference| / std(reference logits) in float32
HALF_MIN_ARGMAX = 0.75  # bf16/fp16: fraction of a forward's positions whose argmax is the reference's
HALF_MIN_AGREEMENT = 0.1  # bf16/fp16: fraction of a path's generated positions equal to the reference's
# contracts: the prompts of decoding_paths, and a prompt of 40 ids (two prefix-cache chunks of 16) for prefix reuse
LONG_PROMPT = [(7 * i + 3) % 250 + 10 for i in range(40)]
LONG_EXTENDED = LONG_PROMPT + [40, 41, 42, 43, 44, 45]


@dataclass
class Check:
    """One check's outcome. ``ok``: True/False, or None when it could not run (``note`` says why).
    ``agreement``: fraction of equal generated positions against the other side (1.0 = equal tokens);
    ``first_difference``: ``[request, position]`` of the first differing token, or None."""

    name: str
    kind: str  # "forward" | "path" | "contract"
    device: str
    dtype: str
    ok: bool | None
    requirement: str
    agreement: float | None = None
    first_difference: list[int] | None = None
    note: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def has_llguidance() -> bool:
    """Whether the constrained paths can run (llguidance is installed)."""
    return importlib.util.find_spec("llguidance") is not None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def requirement(dtype: torch.dtype) -> str:
    """The rule of :func:`judge` for ``dtype``, in words."""
    return "equal tokens" if dtype == torch.float32 else f"agreement >= {HALF_MIN_AGREEMENT}"


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int] | None]:
    """(fraction of equal positions over every request, ``[request, position]`` of the first difference or None);
    positions one side lacks count as different."""
    total = same = 0
    first = None
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        n = max(len(x), len(y))
        total += n
        for i in range(n):
            if i < len(x) and i < len(y) and x[i] == y[i]:
                same += 1
            elif first is None:
                first = [r, i]
    return (same / total if total else 1.0), first


def judge(dtype: torch.dtype, got: list[list[int]], want: list[list[int]], exact: bool = False
          ) -> tuple[bool, float, list[int] | None]:
    """``(ok, agreement, first difference)`` under :func:`requirement` for ``dtype`` (``exact``: equal tokens in
    every dtype)."""
    frac, first = agreement(got, want)
    ok = first is None if exact or dtype == torch.float32 else frac >= HALF_MIN_AGREEMENT
    return ok, frac, first


@contextlib.contextmanager
def strict_float32(dtype: torch.dtype):
    """Inside: float32 matmuls in full float32 (no TF32) when ``dtype`` is float32; the setting is restored."""
    before = torch.get_float32_matmul_precision()
    if dtype == torch.float32:
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Lane:
    """The lane's checkpoints (written once under ``root``, a temporary directory by default) and its loaded
    models, one per ``(checkpoint, device, dtype)``; every run gets a fresh :class:`~unmask.engine.LLM` over them
    (its own prefix cache)."""

    def __init__(self, root: str | Path | None = None):
        self._tmp = None
        if root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="unmask-cuda-lane-")
            root = self._tmp.name
        self.dirs = dp.write_checkpoints(Path(root))
        self._models: dict = {}
        self._refs: dict = {}

    def close(self) -> None:
        self._models.clear()
        if self._tmp is not None:
            self._tmp.cleanup()

    def model(self, checkpoint: str, device: str, dtype: torch.dtype):
        """The checkpoint loaded on ``device`` in ``dtype``, native weights (packing is a CPU-only format)."""
        key = (checkpoint, str(device), dtype)
        if key not in self._models:
            from unmask.engine.model import load_model

            kw = dict(parent=str(self.dirs["causal"])) if checkpoint == "adapter" else {}
            self._models[key] = load_model(self.dirs[checkpoint], device=str(device), dtype=dtype_name(dtype),
                                           weights="native", **kw)
        return self._models[key]

    def llm(self, checkpoint: str, device: str, dtype: torch.dtype, **kw):
        from unmask.engine import LLM

        return LLM(self.model(checkpoint, device, dtype), **kw)

    def reference(self, path: dp.DecodingPath) -> list[list[int]]:
        """The path's tokens on the CPU in float32 (computed once)."""
        if path.name not in self._refs:
            self._refs[path.name] = dp.run_path(self.llm(path.checkpoint, "cpu", torch.float32), path)
        return self._refs[path.name]


def _json_objects(tokenizer, outs: list[list[int]]) -> bool:
    try:
        return all(isinstance(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), dict) for ids in outs)
    except ValueError:
        return False


def _forward_logits(model, prompt: str) -> torch.Tensor:
    """``[Q, V]`` float32 CPU logits of one forward of ``prompt`` + 8 mask tokens (bidirectional attention on a
    bidirectional model, causal elsewhere; the mask rows through the row variant, an adapter's)."""
    ids = model.tokenizer(prompt)["input_ids"] + [model.dllm.mask_token_id] * 8
    n = len(ids)
    dev = model.device
    allowed = torch.ones(n, n, dtype=torch.bool, device=dev)
    if model.dllm.attention != "bidirectional":
        allowed = torch.tril(allowed)
    x = torch.tensor([ids], device=dev)
    variant = (x == model.dllm.mask_token_id)
    with torch.no_grad():
        hidden = model.hidden_states(x, torch.arange(n, device=dev)[None], allowed[None, None], None, variant)
        return model.logits(hidden[0], variant[0]).float().cpu()


def check_forward(lane: Lane, checkpoint: str, device: str, dtype: torch.dtype) -> Check:
    """One forward of ``checkpoint`` on ``(device, dtype)`` against the CPU float32 forward: float32 within
    :data:`FP32_LOGIT_TOLERANCE` with equal argmax; half precision argmax agreement >= :data:`HALF_MIN_ARGMAX`."""
    fp32 = dtype == torch.float32
    check = Check(checkpoint, "forward", str(device), dtype_name(dtype), None,
                  f"argmax equal, |dlogit| <= {FP32_LOGIT_TOLERANCE} std" if fp32
                  else f"argmax agreement >= {HALF_MIN_ARGMAX}")
    t0 = time.perf_counter()
    try:
        want = _forward_logits(lane.model(checkpoint, "cpu", torch.float32), dp.PROMPTS[0])
        with strict_float32(dtype):
            got = _forward_logits(lane.model(checkpoint, device, dtype), dp.PROMPTS[0])
        same = got.argmax(-1) == want.argmax(-1)
        check.agreement = round(float(same.float().mean()), 4)
        err = float((got - want).abs().max() / want.std())
        check.note = f"max |dlogit| / std = {err:.2e}"
        if not bool(same.all()):
            check.first_difference = [0, int((~same).nonzero()[0, 0])]
        check.ok = (bool(same.all()) and err <= FP32_LOGIT_TOLERANCE) if fp32 else check.agreement >= HALF_MIN_ARGMAX
    except Exception as exc:
        check.ok, check.note = False, f"{type(exc).__name__}: {exc}"[:500]
    check.seconds = round(time.perf_counter() - t0, 3)
    return check


def run_forwards(lane: Lane, device: str, dtype: torch.dtype) -> list[Check]:
    """:func:`check_forward` for every checkpoint of the lane."""
    return [check_forward(lane, name, device, dtype) for name in lane.dirs]


def check_path(lane: Lane, path: dp.DecodingPath, device: str, dtype: torch.dtype) -> Check:
    """One decoding path on ``(device, dtype)`` against the CPU float32 reference."""
    check = Check(path.name, "path", str(device), dtype_name(dtype), None, requirement(dtype))
    if path.constrained and not has_llguidance():
        check.note = "skipped: llguidance is not installed (constrained decoding needs it)"
        return check
    t0 = time.perf_counter()
    try:
        want = lane.reference(path)
        with strict_float32(dtype):
            got = dp.run_path(lane.llm(path.checkpoint, device, dtype), path)
        _sync(device)
        check.ok, check.agreement, check.first_difference = judge(dtype, got, want)
        if path.constrained and not _json_objects(lane.model(path.checkpoint, device, dtype).tokenizer, got):
            check.ok, check.note = False, "a constrained output is not a JSON object"
    except Exception as exc:  # a crash on the device is the finding: report it, go on with the next check
        check.ok, check.note = False, f"{type(exc).__name__}: {exc}"[:500]
    check.seconds = round(time.perf_counter() - t0, 3)
    return check


def run_paths(lane: Lane, device: str, dtype: torch.dtype, paths=dp.PATHS) -> list[Check]:
    """Every path of ``paths`` on ``(device, dtype)`` (see :func:`check_path`)."""
    return [check_path(lane, p, device, dtype) for p in paths]


# ------------------------------------------------------------------ contracts (both sides on the device)
def _params(**kw):
    from unmask.engine import SamplingParams

    return SamplingParams.from_flat(**{"max_tokens": 12, "ignore_eos": True, **kw})


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _batch_invariance(lane, checkpoint, params, device, dtype):
    llm = lane.llm(checkpoint, device, dtype, enable_prefix_caching=False)
    batch = _tokens(llm.generate(list(dp.PROMPTS), params))
    alone = [_tokens(llm.generate([p], params))[0] for p in dp.PROMPTS]
    return alone, batch, ""


def _cache_equals_no_cache(lane, device, dtype):
    llm = lane.llm("causal", device, dtype, enable_prefix_caching=False)
    cached = _tokens(llm.generate(list(dp.PROMPTS), _params(temperature=0, speculative=False, block_size=4)))
    plain = _tokens(llm.generate(list(dp.PROMPTS), _params(temperature=0, speculative=False, block_size=4,
                                                           cache="none")))
    return cached, plain, ""


def _prefix_reuse(lane, device, dtype):
    params = _params(temperature=0, speculative=False, block_size=4)
    reuse = lane.llm("causal", device, dtype)
    reuse.generate([LONG_PROMPT], params)
    out = reuse.generate([LONG_EXTENDED], params)[0].outputs[0]
    fresh = lane.llm("causal", device, dtype, enable_prefix_caching=False).generate([LONG_EXTENDED], params)
    note = f"{out.cached_tokens} prompt tokens reused"
    if out.cached_tokens == 0:
        raise AssertionError("the second request reused no prefix: the check would compare nothing")
    return [out.token_ids], _tokens(fresh), note


def _chunked_prefill(lane, device, dtype):
    params = _params(temperature=0, speculative=False, block_size=4)
    runs = [_tokens(lane.llm("causal", device, dtype, enable_prefix_caching=False, prefill_chunk=chunk)
                    .generate([LONG_EXTENDED, LONG_PROMPT], params)) for chunk in (8, 0)]
    return runs[0], runs[1], "chunks of 8 row-equivalents vs the whole prompt"


def _speculative_equals_block_1(lane, device, dtype):
    llm = lane.llm("causal", device, dtype, enable_prefix_caching=False)
    spec = _tokens(llm.generate(list(dp.PROMPTS), _params(temperature=0, speculative=True, block_size=4)))
    b1 = _tokens(llm.generate(list(dp.PROMPTS), _params(temperature=0, speculative=False, block_size=1)))
    return spec, b1, ""


def _adapter_causal_rows(lane, device, dtype, speculative):
    params = _params(temperature=0, block_size=4 if speculative else 1, speculative=speculative)
    adapter = _tokens(lane.llm("adapter", device, dtype, enable_prefix_caching=False).generate(list(dp.PROMPTS),
                                                                                               params))
    parent = _tokens(lane.llm("causal", device, dtype, enable_prefix_caching=False).generate(
        list(dp.PROMPTS), _params(temperature=0, speculative=False, block_size=1)))
    return adapter, parent, ""


# contracts exact in every dtype (docs/design.md#exactness-contracts-by-device-and-dtype: the adapter's causal rows
# are the parent's bit for bit in the same forward, and its block-1 steps are the parent's forwards in shape)
EXACT_IN_EVERY_DTYPE = frozenset({"adapter-block-1-equals-parent"})

CONTRACTS = {
    "batch-invariance-exact-cache": lambda lane, d, t: _batch_invariance(
        lane, "causal", _params(temperature=0, speculative=False, block_size=4), d, t),
    "batch-invariance-sampled": lambda lane, d, t: _batch_invariance(
        lane, "causal", _params(temperature=1.0, seed=5, speculative=False, block_size=4), d, t),
    "batch-invariance-bidirectional": lambda lane, d, t: _batch_invariance(
        lane, "bidirectional", _params(temperature=0, block_size=4, cache="none"), d, t),
    "cache-equals-no-cache": _cache_equals_no_cache,
    "prefix-reuse-equals-fresh-prefill": _prefix_reuse,
    "chunked-prefill-equals-whole-prompt": _chunked_prefill,
    "speculative-greedy-equals-block-1": _speculative_equals_block_1,
    "adapter-block-1-equals-parent": lambda lane, d, t: _adapter_causal_rows(lane, d, t, speculative=False),
    "adapter-speculative-equals-parent": lambda lane, d, t: _adapter_causal_rows(lane, d, t, speculative=True),
}


def run_contracts(lane: Lane, device: str, dtype: torch.dtype, names=None) -> list[Check]:
    """The exactness contracts of :data:`CONTRACTS` (all, or ``names``), both sides on ``(device, dtype)``."""
    checks = []
    for name in names or CONTRACTS:
        exact = name in EXACT_IN_EVERY_DTYPE
        check = Check(name, "contract", str(device), dtype_name(dtype), None,
                      "equal tokens (exact in every dtype)" if exact else requirement(dtype))
        t0 = time.perf_counter()
        try:
            with strict_float32(dtype):
                got, want, check.note = CONTRACTS[name](lane, device, dtype)
            _sync(device)
            check.ok, check.agreement, check.first_difference = judge(dtype, got, want, exact)
        except Exception as exc:
            check.ok, check.note = False, f"{type(exc).__name__}: {exc}"[:500]
        check.seconds = round(time.perf_counter() - t0, 3)
        checks.append(check)
    return checks


def run_lane(device: str, dtype: torch.dtype, lane: Lane | None = None) -> list[Check]:
    """Every forward and path against the CPU float32 reference, then every contract, on ``(device, dtype)``."""
    own = lane is None
    lane = lane or Lane()
    try:
        return run_forwards(lane, device, dtype) + run_paths(lane, device, dtype) + run_contracts(lane, device, dtype)
    finally:
        if own:
            lane.close()


def summary(checks: list[Check]) -> dict:
    """``{"passed", "failed", "skipped", "failures": [names]}`` of a list of checks."""
    return {"passed": sum(c.ok is True for c in checks), "failed": sum(c.ok is False for c in checks),
            "skipped": sum(c.ok is None for c in checks),
            "failures": [f"{c.kind}:{c.name}@{c.device}/{c.dtype}" for c in checks if c.ok is False]}
