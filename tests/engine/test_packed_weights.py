"""fbgemm-packed fp16 linear layers (unmask.engine.packed_weights): what gets packed, logits close to the weights
as loaded (float32, nf4, int8), decoding invariants kept (batch invariance, speculative = block_size=1 greedy, the
verifier-routed answer), and the format resolution and its errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.model import load_model
from unmask.engine.packed_weights import fbgemm_available, pack_linears_fp16, pack_model, resolve_weight_format
from unmask.engine.routed import route_to_verifier

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="fp16 packing needs an fbgemm (x86) torch build")

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


def _packed(model=None, **kw):
    lm = model or tiny.loaded(**kw)
    pack_model(lm, "fp16")
    return lm


def _logits(lm, ids):
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids])).logits[0].float()


def test_every_linear_layer_is_packed_and_logits_stay_close():
    native = tiny.loaded(initializer_range=0.2)
    packed = _packed(tiny.loaded(initializer_range=0.2))
    n_linear = sum(type(m) is nn.Linear for m in native.model.modules())
    assert n_linear == 2 * 7 + 1  # 2 layers x (q, k, v, o, gate, up, down) + the LM head
    assert not any(type(m) is nn.Linear for m in packed.model.modules())
    assert packed.weight_format == "fp16" and packed.vocab_size == native.vocab_size
    ids = native.tokenizer("The quick brown fox").input_ids
    a, b = _logits(native, ids), _logits(packed, ids)
    assert float((a - b).norm() / a.norm()) < 2e-3
    assert not torch.equal(a, b)  # really another kernel (fp16-rounded weights)


def test_pack_count_and_idempotence():
    lm = tiny.loaded()
    assert pack_linears_fp16(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 2)))) == 2
    pack_model(lm, "fp16")
    pack_model(lm, "fp16")  # no-op
    pack_model(lm, "auto")  # no-op
    with pytest.raises(ValueError, match="already packed"):
        pack_model(lm, "native")
    assert lm.weight_format == "fp16"
    with pytest.raises(ValueError, match="before packing"):
        route_to_verifier(lm, tiny.loaded().model)
    with pytest.raises(ValueError, match="compile"):
        LLM(lm, compile=True)
    with pytest.raises(ValueError, match="compile"):
        lm.enable_compile()
    native = tiny.loaded()
    native.enable_compile()  # lazy: nothing is traced before a forward
    native.enable_compile()  # idempotent
    assert native.decoder_path == "compiled"


def test_format_resolution_and_errors():
    cpu = torch.device("cpu")
    assert resolve_weight_format("auto", cpu) == "fp16" and resolve_weight_format(None, cpu) == "fp16"
    assert resolve_weight_format("native", cpu) == "native"
    assert resolve_weight_format("auto", torch.device("cuda")) == "native"
    with pytest.raises(ValueError, match="weights: fp16 .* CPU"):
        resolve_weight_format("fp16", torch.device("cuda"))
    # the packed kernels take float32 activations: a bf16/fp16 model stays as loaded, and asking for fp16 fails
    assert resolve_weight_format("auto", cpu, torch.bfloat16) == "native"
    with pytest.raises(ValueError, match="float32 activations; the model computes in bfloat16"):
        resolve_weight_format("fp16", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="weights: 'int2' is not one of auto, native, fp16, int8, int4"):
        resolve_weight_format("int2", cpu)


def test_load_model_packs_by_default_on_cpu_and_native_opts_out(tmp_path):
    lm = tiny.loaded()
    write_checkpoint(tmp_path / "c", lm.model, lm.tokenizer, lm.dllm)
    assert load_model(tmp_path / "c").weight_format == "fp16"
    assert load_model(tmp_path / "c", weights="native").weight_format == "native"
    assert LLM(str(tmp_path / "c"), weights="native").model.weight_format == "native"
    assert load_model(tmp_path / "c", dtype="bfloat16").weight_format == "native"
    assert LLM(str(tmp_path / "c"), compile=True).model.weight_format == "native"  # compile traces native weights
    with pytest.raises(ValueError, match="weights"):
        load_model(tmp_path / "c", weights="bogus")


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_checkpoints_are_dequantized_then_packed(tmp_path, quantization):
    """A bitsandbytes checkpoint runs its own (dequantized) values in the packed kernels. nf4: logits stay within
    fp16 rounding of the bitsandbytes forward, far closer than the quantization moved them from float32. int8
    (LLM.int8 also quantizes the activations of every call, which the packed kernels do not): at least as close to
    the float32 model as bitsandbytes' own forward (a wrong scale would be far off)."""
    from unmask.training.export import export

    lm = tiny.loaded(initializer_range=0.2)
    write_checkpoint(tmp_path / "src", lm.model, lm.tokenizer, lm.dllm)
    export(str(tmp_path / "src"), str(tmp_path / "q"), quantization=quantization)
    native = load_model(tmp_path / "q", weights="native")
    packed = load_model(tmp_path / "q")
    assert packed.weight_format == "fp16" and packed.decoder_path == "fused"  # fused from the dequantized layers
    ids = lm.tokenizer("The quick brown fox").input_ids
    ref, q_native, q_packed = _logits(lm, ids), _logits(native, ids), _logits(packed, ids)
    quant_err = float((q_native - ref).norm() / ref.norm())
    assert quant_err > 1e-3  # the quantization did move the logits
    if quantization == "nf4":
        pack_err = float((q_packed - q_native).norm() / q_native.norm())
        assert pack_err < 0.05 * quant_err, (pack_err, quant_err)
    else:
        assert float((q_packed - ref).norm() / ref.norm()) <= quant_err


def test_batch_invariance_and_speculative_exactness_hold_packed():
    llm = LLM(_packed(attention="prefix_causal", initializer_range=0.5))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert together == alone
    for p in PROMPTS:
        b1 = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, block_size=1, ignore_eos=True))
        spec = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, block_size=4, speculative=True,
                                              ignore_eos=True))
        assert spec[0].outputs[0].token_ids == b1[0].outputs[0].token_ids


def test_verifier_routed_model_packs_both_weight_sets():
    """Routed modules hold packed drafter and verifier layers: speculative answers are still the (packed)
    verifier's own block_size=1 greedy answers."""
    routed, verifier = tiny.loaded_with_verifier(initializer_range=0.5)
    pack_model(routed, "fp16")
    pack_model(verifier, "fp16")
    assert not any(type(m) is nn.Linear for m in routed.model.modules())
    r_llm, v_llm = LLM(routed), LLM(verifier)
    for p in PROMPTS:
        want = v_llm.generate(p, SamplingParams(max_tokens=10, temperature=0, block_size=1, ignore_eos=True))
        got = r_llm.generate(p, SamplingParams(max_tokens=10, temperature=0, speculative=True, ignore_eos=True))
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
