"""The mask-row adapter (fp16 A/B) over a quantized parent (docs/design.md#mask-row-adapter): an ``unmask export
--quantization nf4|int8`` of the adapter's parent (bitsandbytes layers as loaded, or dequantized and packed) and the
``--weights int8|int4`` low-bit CPU kernels over the full-precision parent. In every case the causal rows of
parent + adapter are the parent's logits bit for bit through the same low-bit path, the mask rows see the adapter,
a row's logits do not depend on its batch mates, the adapter's tensors keep their fp16 values, and an export of
another parent (or one whose weights changed after the export) is refused in one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams, lowbit
from unmask.engine.adapter_files import ADAPTER_WEIGHTS, EXPORT_RECORD, parent_hash, write_adapter
from unmask.engine.attention import build_attention_mask
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError
from unmask.engine.mask_adapter import MaskLoRALinear, init_adapter
from unmask.engine.model import load_model
from unmask.engine.packed_weights import fbgemm_available

LOWBIT = lowbit.lowbit_unavailable("int4", torch.device("cpu"), torch.float32) is None and \
    lowbit.lowbit_unavailable("int8", torch.device("cpu"), torch.float32) is None
needs_lowbit = pytest.mark.skipif(not LOWBIT, reason="no low-bit CPU kernels in this torch/CPU")
needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm in this torch build")

#: (checkpoint, --weights): the low-bit kernels over the fp parent, and the bitsandbytes exports as loaded /
#: dequantized into the packed kernels
CASES = [pytest.param("parent", "int8", marks=needs_lowbit), pytest.param("parent", "int4", marks=needs_lowbit),
         ("nf4", "native"), pytest.param("nf4", "fp16", marks=needs_fbgemm),
         pytest.param("nf4", "int4", marks=needs_lowbit), pytest.param("int8", "int8", marks=needs_lowbit),
         pytest.param("int8", "fp16", marks=needs_fbgemm)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from unmask.training.export import export

    tmp = tmp_path_factory.mktemp("adapter_lowbit")
    m = tiny.loaded(initializer_range=0.5)
    write_checkpoint(tmp / "parent", m.model, m.tokenizer, m.dllm)
    w = init_adapter(m.model.base_model, 4, 8.0, mask_token_id=m.dllm.mask_token_id,
                     generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    for k, (a, b) in w.layers.items():  # a non-zero B: a fresh adapter is the identity
        w.layers[k] = (a, 0.5 * torch.randn(b.shape, generator=g))
    w.mask_embedding = torch.randn(w.mask_embedding.shape, generator=g)
    write_adapter(tmp / "adapter", w, {"sha256": parent_hash(tmp / "parent"), "name": str(tmp / "parent")},
                  dllm={"block_size": 4}, dtype=torch.float16)
    for q in ("nf4", "int8"):
        export(str(tmp / "parent"), str(tmp / q), quantization=q, verify=False)
    return tmp


def _rows(lm, tokens):
    """One forward of ``len(tokens)`` sequences, each 6 committed causal rows + a 4-row mask group (a speculative
    step's layout): logits ``[B, 10, V]`` and the committed rows ``[10]``."""
    P, G = 6, 4
    B = len(tokens)
    ids = torch.tensor([t + [lm.dllm.mask_token_id] * G for t in tokens])
    pos = torch.tensor([list(range(P + G))] * B)
    grp = torch.tensor([list(range(P)) + [1 << 40] * G] * B)
    start = torch.tensor([list(range(P)) + [P] * G] * B)
    committed = torch.tensor([[True] * P + [False] * G] * B)
    valid = torch.ones_like(committed)
    mask = build_attention_mask(pos, grp, start, valid, pos, grp, committed, valid)
    variant = ~committed if lm.has_row_variant else None
    with torch.inference_mode():
        h = lm.hidden_states(ids, pos, mask, variant_rows=variant)
        flat = lm.logits(h.reshape(B * (P + G), -1), variant_rows=None if variant is None else variant.reshape(-1))
    return flat.reshape(B, P + G, -1), committed[0]


SEQ = [[5, 17, 33, 9, 41, 12], [7, 3, 250, 19, 8, 100], [60, 61, 62, 63, 64, 65]]


@pytest.mark.parametrize("ckpt,weights", CASES)
def test_causal_rows_are_the_parents_bit_for_bit_through_the_same_lowbit_path(ckpts, ckpt, weights):
    parent = load_model(ckpts / ckpt, weights=weights)
    adapted = load_model(ckpts / ckpt, adapter=ckpts / "adapter", weights=weights)
    assert adapted.weight_format == parent.weight_format == weights
    a = adapted.adapter
    assert a["weights"] == weights and a["tensor_dtype"] == "float16"
    if ckpt == "parent":
        assert a["relation"] == "same"
    else:  # accepted through the export's record of its fp source, and the record says so
        assert a["relation"] == "quantized export" and a["quantization"] == ckpt
        assert a["loaded_sha256"] == parent_hash(ckpts / ckpt) != a["parent_sha256"] == parent_hash(ckpts / "parent")
    lp, committed = _rows(parent, SEQ[:1])
    la, _ = _rows(adapted, SEQ[:1])
    assert torch.equal(lp[0, committed], la[0, committed])
    assert (lp[0, ~committed] - la[0, ~committed]).abs().max() > 1e-2  # the adapter applies on mask rows


@pytest.mark.parametrize("ckpt,weights", [("parent", "native")] + [c for c in CASES if c != ("nf4", "native")])
def test_a_rows_logits_do_not_depend_on_its_batch_mates(ckpts, ckpt, weights):
    """Mask rows included: the adapter's delta is computed row by row (it failed for native and fp16 when it was
    one float32 GEMM over the selected rows)."""
    adapted = load_model(ckpts / ckpt, adapter=ckpts / "adapter", weights=weights)
    alone, _ = _rows(adapted, SEQ[:1])
    for company in (SEQ[:2], [SEQ[0], SEQ[2], SEQ[1]]):
        batched, _ = _rows(adapted, company)
        assert torch.equal(batched[0], alone[0])


@needs_lowbit
def test_the_adapter_keeps_its_fp16_values_over_int4_weights(ckpts):
    from safetensors.torch import load_file

    adapted = load_model(ckpts / "parent", adapter=ckpts / "adapter", weights="int4")
    stored = load_file(str(ckpts / "adapter" / ADAPTER_WEIGHTS))
    assert all(t.dtype == torch.float16 for t in stored.values())
    o_proj = adapted.model.base_model.layers[1].self_attn.o_proj
    assert isinstance(o_proj, MaskLoRALinear) and type(o_proj.base).__name__ == "LowbitLinear"
    assert torch.equal(o_proj.lora_A, stored["layers.1.o_proj.lora_A"].float())  # not re-quantized
    assert torch.equal(o_proj.lora_B, stored["layers.1.o_proj.lora_B"].float())


@needs_lowbit
def test_block1_greedy_over_an_nf4_export_in_int4_is_the_parents(ckpts):
    kw = SamplingParams.from_flat(max_tokens=12, ignore_eos=True, temperature=0, block_size=1)
    parent = LLM(load_model(ckpts / "nf4", weights="int4"))
    adapted = LLM(load_model(ckpts / "nf4", adapter=ckpts / "adapter", weights="int4"))
    ref = parent.generate("Hello world the quick", kw)[0].outputs[0].token_ids
    assert adapted.generate("Hello world the quick", kw)[0].outputs[0].token_ids == ref
    plain = SamplingParams.from_flat(max_tokens=12, ignore_eos=True, temperature=0, block_size=4, speculative=False)
    assert (adapted.generate("Hello world the quick", plain)[0].outputs[0].token_ids
            != parent.generate("Hello world the quick", plain)[0].outputs[0].token_ids)


def test_an_export_of_another_parent_is_refused_in_one_line(ckpts, tmp_path):
    from unmask.training.export import export

    other = tiny.loaded(initializer_range=0.5, seed=3)
    write_checkpoint(tmp_path / "other", other.model, other.tokenizer, other.dllm)
    export(str(tmp_path / "other"), str(tmp_path / "other-nf4"), quantization="nf4", verify=False)
    with pytest.raises(CheckpointError, match=r"parent hash .* differs .*\(an export of sha256:") as err:
        load_model(tmp_path / "other-nf4", adapter=ckpts / "adapter", weights="native")
    assert "\n" not in str(err.value)


def test_an_export_whose_weights_changed_or_that_lacks_the_record_is_refused(ckpts, tmp_path):
    # another model's nf4 weights under the real export's config (which names our parent): the recorded sha256
    # of the export no longer matches its tensors
    from unmask.training.export import export

    other = tiny.loaded(initializer_range=0.5, seed=4)
    write_checkpoint(tmp_path / "other", other.model, other.tokenizer, other.dllm)
    export(str(tmp_path / "other"), str(tmp_path / "o"), quantization="nf4", verify=False)
    shutil.copytree(ckpts / "nf4", tmp_path / "forged", ignore=shutil.ignore_patterns(".unmask-content-hash.json"))
    shutil.copy2(tmp_path / "o" / "model.safetensors", tmp_path / "forged" / "model.safetensors")
    with pytest.raises(CheckpointError, match="weights changed after the export") as err:
        load_model(tmp_path / "forged", adapter=ckpts / "adapter", weights="native")
    assert "\n" not in str(err.value)
    # a quantized parent without the record (e.g. quantized by hand): its own hash only, refused
    shutil.copytree(ckpts / "nf4", tmp_path / "bare", ignore=shutil.ignore_patterns(".unmask-content-hash.json"))
    cfg = json.loads((tmp_path / "bare" / "config.json").read_text())
    del cfg[EXPORT_RECORD]
    (tmp_path / "bare" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="parent hash .* differs"):
        load_model(tmp_path / "bare", adapter=ckpts / "adapter", weights="native")


def test_the_export_records_its_source(ckpts):
    rec = json.loads((ckpts / "nf4" / "config.json").read_text())[EXPORT_RECORD]
    assert rec == {"quantization": "nf4", "source_sha256": parent_hash(ckpts / "parent"),
                   "sha256": parent_hash(ckpts / "nf4")}


@needs_lowbit
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_lowbit_decoding_uses_row_invariant_attention_end_to_end(ckpts, weights):
    """int4/int8 run the fused decoder with row-invariant attention (engine/row_attention.py), fp16 does not; with
    it, speculative greedy decoding of the adapter model is its block-1 decoding token for token and a request's
    tokens do not depend on its batch mates (prompts of different lengths: padded keys and queries)."""
    adapted = load_model(ckpts / "parent", adapter=ckpts / "adapter", weights=weights)
    assert adapted.decoder_forward.row_invariant
    if fbgemm_available():
        assert not load_model(ckpts / "parent", weights="fp16").decoder_forward.row_invariant
    llm = LLM(adapted, max_batch_size=4)
    prompts = ["Hello world the quick", "One two", "The lazy dog jumps over the fox again and again", "Paris"]
    b1 = SamplingParams.from_flat(max_tokens=16, ignore_eos=True, temperature=0, block_size=1)
    spec = SamplingParams.from_flat(max_tokens=16, ignore_eos=True, temperature=0, block_size=4, speculative=True)
    alone = [llm.generate(p, b1)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, b1)] == alone
    assert [llm.generate(p, spec)[0].outputs[0].token_ids for p in prompts] == alone
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, spec)] == alone


@needs_lowbit
def test_int4_prompt_tiles_give_the_same_kv_bits_however_the_prompt_arrives(ckpts):
    """Under row-invariant attention prompt rows run in fixed tiles (engine/row_attention.py): the same KV bits with
    the whole prompt in the first step, in chunks of 7 (chunked prefill) or after a prefix from the cache; the
    prefix cache keeps prompt rows only (an answer's rows are block-1 calls), and a chat gets the same tokens with
    and without reuse."""
    from unmask.engine.engine import Engine

    adapted = load_model(ckpts / "parent", adapter=ckpts / "adapter", weights="int4")
    assert adapted.tiles_prompt_rows
    prompt = torch.randint(5, 300, (75,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams.from_flat(max_tokens=6, ignore_eos=True, temperature=0, block_size=1)

    def first_step_kv(engine, ids):
        engine.add_request(ids, params, f"r{len(ids)}-{id(engine)}")
        while not engine.step():
            pass
        cache = engine.scheduler.running[0].lanes[0].cache
        return [t[..., :len(ids), :].clone() for t in cache.keys + cache.values]

    whole = first_step_kv(Engine(adapted, prefill_chunk=0, enable_prefix_caching=False), prompt)
    chunked = first_step_kv(Engine(adapted, prefill_chunk=7, enable_prefix_caching=False), prompt)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    # a chat's next turn: the first prompt (45 tokens) + its answer (6) + more; only the prompt's whole chunks
    # (32 positions) are reused, not the 48 that its answer would complete
    turn1 = LLM(adapted).generate([prompt[:45]], params)[0].outputs[0].token_ids
    chat = prompt[:45] + turn1 + prompt[45:]
    fresh = first_step_kv(Engine(adapted, prefill_chunk=0, enable_prefix_caching=False), chat)
    shared = Engine(adapted, prefill_chunk=0)
    shared.add_request(prompt[:45], params, "first")
    while shared.has_unfinished():
        shared.step()
    reused = first_step_kv(shared, chat)
    assert shared.scheduler.running[0].cached_tokens == 32
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    with_reuse = LLM(adapted)
    with_reuse.generate([prompt[:45]], params)
    assert (with_reuse.generate([chat], params)[0].outputs[0].token_ids
            == LLM(adapted, enable_prefix_caching=False).generate([chat], params)[0].outputs[0].token_ids)
