"""The CPU cells of docs/design.md#exactness-contracts-by-device-and-dtype: each claim (batch invariance,
speculative greedy = block 1, prefix reuse = fresh prefill, exact cache = no cache, chunked = whole prefill, the
mask-row adapter's causal rows = its parent's) in each weight format and dtype the engine offers on a CPU, exact
where the table says exact (tokens and every step's logits bit for bit) and within the table's tolerance elsewhere
(checks in ``tests/contracts.py``); the plan's defaults per device; the nf4 compute dtype at load."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import contracts
import tiny
from unmask.engine import SamplingParams, lowbit
from unmask.engine import engine as engine_module
from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import DllmConfig
from unmask.engine.engine import Engine, plan_request
from unmask.engine.model import load_model, resolve_dtype
from unmask.engine.packed_weights import fbgemm_available
from unmask.engine.plan import resolve
from unmask.engine.sequence import Sequence

#: the table's tolerances: largest |logit difference| / the step's largest |logit| while both sides decode the
#: same canvas (tokens may part only right after a near-tie at twice that)
FLOAT32_TOL = 1e-4  # float32 activations (native, fp16-packed, bitsandbytes nf4): measured <= 2e-5
BF16_TOL = 5e-2  # bfloat16 activations: measured <= 7e-3 on these 2-layer models


@dataclass(frozen=True)
class Format:
    """A column of the table on the CPU: the checkpoint, ``dtype`` and ``--weights`` it loads with, the tolerance
    (``None`` = exact) and the weight format it must resolve to (else the cell cannot run here: skipped)."""

    checkpoint: str
    dtype: str
    weights: str
    tol: float | None
    runs_as: str


FORMATS = {
    "native": Format("model", "float32", "native", FLOAT32_TOL, "native"),
    "fp16": Format("model", "float32", "fp16", FLOAT32_TOL, "fp16"),
    "int8": Format("model", "float32", "int8", None, "int8"),
    "int4": Format("model", "float32", "int4", None, "int4"),
    "auto-int4": Format("grid", "float32", "auto", None, "int4"),  # weights on the int4 grid (a Q4_1 GGUF's)
    "bf16": Format("model", "bfloat16", "native", BF16_TOL, "native"),
    "nf4": Format("nf4", "float32", "native", FLOAT32_TOL, "native"),  # bitsandbytes nf4 as loaded
}
CLAIMS = {"batch": contracts.check_batch_invariance, "speculative": contracts.check_speculative_is_block_1,
          "prefix-reuse": contracts.check_prefix_reuse, "cache": contracts.check_cache_is_no_cache,
          "chunked-prefill": contracts.check_chunked_prefill}


def _runnable(fmt: Format) -> str | None:
    """Why this format cannot run on this CPU (the engine would fall back to another), or None."""
    cpu = torch.device("cpu")
    if fmt.runs_as == "fp16" and not fbgemm_available():
        return "no fbgemm in this torch build"
    if fmt.runs_as in ("int8", "int4"):
        why = lowbit.lowbit_unavailable(fmt.runs_as, cpu, torch.float32)
        if why is None and fmt.weights == "auto" and not fbgemm_available():
            why = "auto's int4 case needs fbgemm"
        return why
    return None


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contracts")
    out = {}
    for attention in ("prefix_causal", "block_causal"):
        kw = dict(block_alignment="absolute", fixed_block_size=True) if attention == "block_causal" else {}
        for name, snap in (("model", False), ("grid", True)):
            m = tiny.loaded(attention=attention, block_size=4, initializer_range=0.5, **kw)
            if snap:
                tiny.snap_decoder_to_int4_grid(m)
            out[name, attention] = write_checkpoint(tmp / f"{name}-{attention}", m.model, m.tokenizer, m.dllm)
    return tmp, out


@pytest.fixture(scope="module")
def models(ckpts):
    """``load(format name, attention)`` -> the loaded model (cached); skips a format this CPU cannot run."""
    tmp, dirs = ckpts
    cache = {}

    def load(name: str, attention: str = "prefix_causal"):
        fmt = FORMATS[name]
        why = _runnable(fmt)
        if why:
            pytest.skip(f"{name}: {why}")
        if (name, attention) not in cache:
            if fmt.checkpoint == "nf4":
                path = tmp / f"nf4-{attention}"
                if not path.exists():
                    from unmask.training.export import export

                    export(str(dirs["model", attention]), str(path), quantization="nf4", verify=False)
            else:
                path = dirs[fmt.checkpoint, attention]
            m = load_model(path, device="cpu", dtype=fmt.dtype, weights=fmt.weights)
            assert m.weight_format == fmt.runs_as and str(m.dtype) == f"torch.{fmt.dtype}"
            cache[name, attention] = m
        return cache[name, attention]

    return load


@pytest.mark.parametrize("claim", CLAIMS)
@pytest.mark.parametrize("name", FORMATS)
def test_a_cpu_cell_holds(models, name, claim):
    """docs/design.md#exactness-contracts-by-device-and-dtype, one cell (prefix-causal model)."""
    CLAIMS[claim](models(name), FORMATS[name].tol)


@pytest.mark.parametrize("claim", ["batch", "cache", "chunked-prefill", "prefix-reuse"])
@pytest.mark.parametrize("name", ["native", "int4", "bf16"])
def test_a_cpu_cell_holds_on_a_block_causal_model(models, name, claim):
    CLAIMS[claim](models(name, "block_causal"), FORMATS[name].tol)


def test_logit_bias_keeps_the_exact_cache_equal_to_no_cache():
    """The carry (a block's first prediction, read again at later steps) is the model's output: before, it was a
    view of a row the sampler had edited in place, so ``logit_bias`` counted twice with the cache and once
    without it (4 of 24 requests of this kind differed)."""
    model = tiny.loaded(block_size=4, initializer_range=0.5)
    engine = Engine(model, enable_prefix_caching=False)
    bias = {t: 4.0 for t in range(0, 320, 7)}
    for prompt in contracts.PROMPTS:
        kw = dict(max_tokens=12, block_size=4, logit_bias=bias, **contracts.GREEDY)
        none = contracts.decode(engine, [(prompt, SamplingParams(cache="none", **kw))])[0]
        cached = contracts.decode(engine, [(prompt, SamplingParams(cache="auto", **kw))])[0]
        contracts.assert_same_decoding(none, cached, FLOAT32_TOL, f"logit_bias, {prompt!r}")


def test_the_adapters_causal_rows_are_the_parents_in_bf16(ckpts, tmp_path):
    """The bf16 cell of the adapter row (the other formats: tests/engine/test_mask_adapter.py and
    test_adapter_lowbit.py): block 1 through the adapter model = the parent's block 1, every step's logits bit for
    bit, and speculative greedy = that answer within the bf16 cell's tolerance."""
    _, dirs = ckpts
    parent_dir = dirs["model", "prefix_causal"]
    parent = load_model(parent_dir, device="cpu", dtype="bfloat16")
    w = tiny.random_adapter_weights(tiny.loaded(block_size=4, initializer_range=0.5))
    write_adapter(tmp_path / "adapter", w, {"sha256": parent_hash(parent_dir), "name": str(parent_dir)},
                  dllm={"block_size": 4})
    adapted = load_model(tmp_path / "adapter", device="cpu", dtype="bfloat16")
    assert adapted.has_row_variant and adapted.dtype == torch.bfloat16
    b1 = SamplingParams(max_tokens=10, block_size=1, **contracts.GREEDY)
    for prompt in contracts.PROMPTS:
        ref = contracts.decode(Engine(parent, enable_prefix_caching=False), [(prompt, b1)])[0]
        got = contracts.decode(Engine(adapted, enable_prefix_caching=False), [(prompt, b1)])[0]
        contracts.assert_same_decoding(ref, got, None, f"adapter block 1 in bf16, {prompt!r}")
    contracts.check_speculative_is_block_1(adapted, BF16_TOL)  # the adapter drafts, the parent verifies


# ---------------------------------------------------------------- defaults that follow the contract


def _speculative_default_dllm() -> DllmConfig:
    """The tiny model's settings with a checkpoint that decodes greedy requests speculatively by default."""
    d = tiny.loaded(block_size=4).dllm
    d.default_sampling = {"speculative": True, "temperature": 0.0}
    return d


@pytest.mark.parametrize("device_type, draft_block", [("cuda", 4), ("cpu", 1)])
def test_a_gpu_keeps_drafting_by_default_and_a_cpu_decodes_block_1(device_type, draft_block):
    """``default_drafts=auto``: a checkpoint-default speculative request drafts its block on a GPU (whatever the
    dtype: the plan does not read it) and decodes block 1 on a CPU; an explicit block or policy wins."""
    d = _speculative_default_dllm()
    plan = resolve(SamplingParams(max_tokens=8, seed=1), d, "auto", device_type=device_type)
    assert plan.speculative and plan.draft_block == draft_block and plan.temperature == 0
    assert resolve(SamplingParams(max_tokens=8, seed=1), d, "off", device_type="cuda").draft_block == 1
    assert resolve(SamplingParams(max_tokens=8, seed=1, block_size=2), d, "auto", device_type="cpu").draft_block == 2


def test_a_request_built_by_the_engine_on_a_faked_gpu_gets_the_gpus_plan(monkeypatch):
    """One resolution path: Engine.make_request (and its KV-budget sizing) resolves with the engine's policy and
    the model's device; a Request refuses an unresolved SamplingParams instead of resolving it again without
    them."""
    model = tiny.loaded(block_size=4)
    model.dllm.default_sampling = {"speculative": True, "temperature": 0.0}
    engine = Engine(model, enable_prefix_caching=False)
    built = []

    class Recorder:
        def __init__(self, request_id, prompt_ids, plan, *args, **kwargs):
            built.append(plan)

    for kind in ("Sequence", "SpeculativeSequence", "MultiBlockSequence"):
        monkeypatch.setattr(engine_module, kind, Recorder)
    monkeypatch.setattr(model, "device", torch.device("cuda"))  # only its type is read before the Request
    params = SamplingParams(max_tokens=8, seed=5)
    engine.make_request([5, 6, 7], params, "r")
    assert built == [resolve(params, model.dllm, "auto", device_type="cuda")]
    assert built[0].draft_block == 4 and plan_request(model, params) == built[0]
    monkeypatch.setattr(model, "device", torch.device("cpu"))
    engine.make_request([5, 6, 7], params, "r")
    assert built[1] == resolve(params, model.dllm, "auto", device_type="cpu") and built[1].draft_block == 1
    with pytest.raises(TypeError, match="DecodingPlan"):
        Sequence("r", [5, 6, 7], params, model.dllm, model.tokenizer, model.max_context)


# ---------------------------------------------------------------- nf4: the serving dtype computes


@pytest.fixture(scope="module")
def nf4_export(ckpts):
    """An nf4 export made on this CPU (``bnb_4bit_compute_dtype: float32`` recorded)."""
    from unmask.training.export import export

    tmp, dirs = ckpts
    path = tmp / "nf4-compute"
    export(str(dirs["model", "prefix_causal"]), str(path), quantization="nf4", verify=False)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["bnb_4bit_compute_dtype"] == \
        "float32"
    return path


def _compute_dtypes(model) -> set:
    return {m.compute_dtype for m in model.model.modules() if type(m).__name__ == "Linear4bit"}


def test_nf4_layers_compute_in_the_serving_dtype_not_the_exports(nf4_export, monkeypatch):
    """The dtype ``auto`` resolves to on a bf16 GPU (faked: the load itself runs on this CPU) reaches every 4-bit
    layer although the export recorded float32; a CPU's float32 is kept; and an export made on a GPU (bfloat16
    recorded) served on a CPU computes in float32."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu_dtype = resolve_dtype("auto", torch.device("cuda"))
    assert gpu_dtype == torch.bfloat16
    served = load_model(nf4_export, device="cpu", dtype=gpu_dtype, weights="native")
    assert _compute_dtypes(served) == {torch.bfloat16}
    assert served.model.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
    assert _compute_dtypes(load_model(nf4_export, device="cpu", weights="native")) == {torch.float32}
    config = json.loads((nf4_export / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_compute_dtype"] = "bfloat16"  # as training/export.py writes on a GPU
    (nf4_export / "config.json").write_text(json.dumps(config))
    assert _compute_dtypes(load_model(nf4_export, device="cpu", weights="native")) == {torch.float32}
