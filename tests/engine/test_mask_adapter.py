"""The mask-row adapter (unmask.engine.mask_adapter, docs/design.md#mask-row-adapter): only non-committed rows see the
delta (causal rows are the parent's bit for bit through the same engine path: native, fp16-packed, and auto's int4
case on a parent whose weights lie on a Q4 GGUF's grid, the default model's format), block 1
and speculative decoding give the parent's tokens, plain diffusion differs, adapter-only = self-contained, and a
parent with another content hash is refused."""
from __future__ import annotations

import json

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.adapter_files import (ADAPTER_CONFIG, parent_hash, read_adapter, write_adapter,
                                         write_self_contained)
from unmask.engine.attention import build_attention_mask
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError
from unmask.engine.lowbit import lowbit_unavailable
from unmask.engine.model import load_model
from unmask.engine.packed_weights import fbgemm_available

#: --weights values; "auto-grid" = auto on the parent moved onto the int4 grid (it runs int4 + an fp16 head)
FORMATS = ["native"] + (["fp16"] if fbgemm_available() else []) + (
    ["auto-grid"] if fbgemm_available() and lowbit_unavailable("int4", torch.device("cpu"), torch.float32) is None
    else [])
PROMPT = "Hello world the quick brown"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mask_adapter")
    m = tiny.loaded(initializer_range=0.5)
    write_checkpoint(tmp / "parent", m.model, m.tokenizer, m.dllm)
    w = tiny.random_adapter_weights(m)
    write_adapter(tmp / "adapter", w, {"sha256": parent_hash(tmp / "parent"), "name": str(tmp / "parent")},
                  dllm={"block_size": 4, "default_sampling": {"speculative": True, "temperature": 0.0}})
    write_self_contained(tmp / "self_contained", tmp / "parent", tmp / "adapter")
    tiny.snap_decoder_to_int4_grid(m)
    write_checkpoint(tmp / "grid_parent", m.model, m.tokenizer, m.dllm)
    write_adapter(tmp / "grid_adapter", w, {"sha256": parent_hash(tmp / "grid_parent"), "name": str(tmp / "grid_parent")},
                  dllm={"block_size": 4, "default_sampling": {"speculative": True, "temperature": 0.0}})
    return tmp


def _load_pair(ckpts, weights):
    """``(parent, adapted)`` loaded models for a :data:`FORMATS` entry."""
    if weights == "auto-grid":
        parent, adapted = load_model(ckpts / "grid_parent"), load_model(ckpts / "grid_adapter")
        assert parent.weight_format == adapted.weight_format == "int4" and parent.packed_layers["fp16"] == 1
        return parent, adapted
    return load_model(ckpts / "parent", weights=weights), load_model(ckpts / "adapter", weights=weights)


def _forward_rows(lm):
    """One forward of 6 committed causal rows followed by a 4-row mask group (as a speculative step's):
    ``(hidden [10, H], variant_rows [10])``."""
    P, G = 6, 4
    ids = torch.tensor([[5, 17, 33, 9, 41, 12] + [lm.dllm.mask_token_id] * G])
    pos = torch.tensor([list(range(P)) + list(range(P, P + G))])
    grp = torch.tensor([list(range(P)) + [1 << 40] * G])
    start = torch.tensor([list(range(P)) + [P] * G])
    committed = torch.tensor([[True] * P + [False] * G])
    valid = torch.ones_like(committed)
    mask = build_attention_mask(pos, grp, start, valid, pos, grp, committed, valid)
    with torch.inference_mode():
        h = lm.hidden_states(ids, pos, mask, variant_rows=~committed if lm.has_row_variant else None)
        logits = lm.logits(h[0], variant_rows=~committed[0] if lm.has_row_variant else None)
    return logits, committed[0]


@pytest.mark.parametrize("weights", FORMATS)
def test_causal_rows_are_the_parents_bit_for_bit_and_mask_rows_see_the_adapter(ckpts, weights):
    parent, adapted = _load_pair(ckpts, weights)
    assert adapted.has_row_variant and adapted.adapter["rank"] == 4 and adapted.weight_format == parent.weight_format
    lp, committed = _forward_rows(parent)
    la, _ = _forward_rows(adapted)
    assert torch.equal(lp[committed], la[committed])
    assert (lp[~committed] - la[~committed]).abs().max() > 1e-2


def _gen(llm, **kw):
    return llm.generate(PROMPT, SamplingParams.from_flat(max_tokens=14, ignore_eos=True, **kw))[0].outputs[0]


@pytest.mark.parametrize("weights", FORMATS)
def test_block1_and_speculative_give_the_parents_tokens_and_diffusion_differs(ckpts, weights):
    parent, adapted = (LLM(m) for m in _load_pair(ckpts, weights))
    ref = _gen(parent, temperature=0, block_size=1).token_ids
    assert _gen(adapted, temperature=0, block_size=1).token_ids == ref
    for branches in (None, 0):
        spec = _gen(adapted, block_size=4, speculative=True, speculative_branches=branches)
        assert spec.speculative and spec.token_ids == ref
    default = _gen(adapted)  # the adapter's default: speculative, greedy
    assert default.token_ids == ref
    plain = dict(temperature=0, block_size=4, speculative=False)
    assert _gen(adapted, **plain).token_ids != _gen(parent, **plain).token_ids


def test_constrained_speculative_greedy_gives_the_parents_constrained_block_1(ckpts):
    """A grammar holds on the adapter's speculative path (its causal rows are the parent's): the constrained answer
    is the parent's constrained block-1 answer (docs/design.md#constrained-decoding)."""
    from test_constraints import assert_speculative_constrained_greedy_is_constrained_block_1

    adapted, parent = LLM(load_model(ckpts / "adapter")), LLM(load_model(ckpts / "parent"))
    assert_speculative_constrained_greedy_is_constrained_block_1(adapted, parent)


def test_adapter_only_and_self_contained_give_the_same_tokens(ckpts):
    a = LLM(load_model(ckpts / "adapter", parent=ckpts / "parent"))
    b = LLM(load_model(ckpts / "self_contained"))
    c = LLM(load_model(ckpts / "parent", adapter=ckpts / "adapter"))
    d = LLM(str(ckpts / "parent"), adapter=str(ckpts / "adapter"))  # the README's LLM(dir, adapter=..., parent=...)
    e = LLM(str(ckpts / "adapter"), parent=str(ckpts / "parent"))
    kw = dict(temperature=0, block_size=4, speculative=False)
    assert (_gen(a, **kw).token_ids == _gen(b, **kw).token_ids == _gen(c, **kw).token_ids
            == _gen(d, **kw).token_ids == _gen(e, **kw).token_ids)
    assert d.model.adapter and e.model.adapter
    assert json.loads((ckpts / "self_contained" / ADAPTER_CONFIG).read_text())["parent"]["name"] == "."


def test_a_parent_with_another_hash_is_refused_in_one_line(ckpts, tmp_path):
    other = tiny.loaded(initializer_range=0.5, seed=3)
    write_checkpoint(tmp_path / "other", other.model, other.tokenizer, other.dllm)
    with pytest.raises(CheckpointError, match="parent hash .* differs") as err:
        load_model(ckpts / "adapter", parent=tmp_path / "other")
    assert "\n" not in str(err.value)


def test_adapter_only_without_a_findable_parent_names_it(ckpts, tmp_path):
    import shutil

    shutil.copytree(ckpts / "adapter", tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    cfg["parent"]["name"] = "nowhere"
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="parent"):
        load_model(tmp_path / "ad")


def test_bad_adapter_tensors_name_the_file(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    import shutil

    shutil.copytree(ckpts / "adapter", tmp_path / "ad")
    f = tmp_path / "ad" / "mask_adapter.safetensors"
    t = load_file(str(f))
    t.pop(next(k for k in t if k.endswith("lora_B")))
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match="mask_adapter.safetensors"):
        read_adapter(tmp_path / "ad")


def test_bad_adapter_directories_and_targets_are_one_line_errors(ckpts, tmp_path):
    """A missing directory, a directory without the json, and an unknown target name each name what is wrong (an
    unknown target was a KeyError traceback; a missing directory was blamed on the json's format)."""
    import shutil

    with pytest.raises(CheckpointError, match="no such adapter directory"):
        read_adapter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="mask_adapter.json: missing"):
        read_adapter(tmp_path / "empty")
    shutil.copytree(ckpts / "adapter", tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    cfg["targets"] = ["nonsense_proj"] + cfg["targets"][1:]
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="field 'targets'.*nonsense_proj") as err:
        load_model(ckpts / "parent", adapter=tmp_path / "ad")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("k,out,r", [(576, 1536, 16), (1536, 576, 16), (576, 960, 48)])
def test_a_mask_rows_delta_does_not_depend_on_how_many_rows_are_selected(k, out, r):
    """SmolLM2's shapes (hidden 576, MLP 1536, fused qkv with stacked A): one row's adapter delta is the same bit
    for bit whether it is selected alone or with 1..40 others at any position (several DELTA_CHUNKs). Failed when
    the delta was one float32 GEMM over all selected rows (MKL picks its kernel by the row count).

    The base outputs zeros, so the layer's output *is* the delta, bit for bit: ``layer(x) - nn.Linear(x)`` was not
    (a native float32 ``nn.Linear`` gives other bits by row count on some CPUs' BLAS kernels, and (b + d) - b is
    not d; the native-fp32 contract in docs/design.md says so)."""
    from types import SimpleNamespace

    from unmask.engine.mask_adapter import MaskLoRALinear

    class ZeroBase(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(*x.shape[:-1], out)

    g = torch.Generator().manual_seed(0)
    state = SimpleNamespace(index=None, shape=None)
    layer = MaskLoRALinear(ZeroBase(), torch.randn(r, k, generator=g) * 0.05, torch.randn(out, r, generator=g) * 0.05,
                           2.0, state)
    x0 = torch.randn(k, generator=g)

    def delta_of_x0(n: int, at: int) -> torch.Tensor:
        x = torch.randn(n + 3, k, generator=g)
        x[at] = x0
        state.index, state.shape = torch.arange(n), (n + 3,)
        with torch.inference_mode():
            y = layer(x)
        state.index = state.shape = None
        assert not y[n:].any()  # unselected rows keep the base's output
        return y[at]

    alone = delta_of_x0(1, 0)
    assert alone.any()
    for n in (2, 3, 5, 8, 15, 16, 17, 31, 33, 40):
        for at in (0, n // 2, n - 1):
            assert torch.equal(delta_of_x0(n, at), alone), (n, at)


def test_block1_steps_skip_the_adapter_wrappers(ckpts, monkeypatch):
    """A forward without mask rows (every block-1 step) calls the parent's layers directly through the fused
    decoder's plan (``MaskLoRALinear.as_function``), not the wrapper modules: block 1 of the adapter model runs at
    the parent's speed (docs/adapter.md, "Measured"); rows with masks still get the delta (through the wrapper, or
    ``_dense_delta`` in a forward of at most ``DENSE_DELTA_ROWS`` rows)."""
    from unmask.engine.mask_adapter import MaskLoRALinear

    from unmask.engine import mask_adapter

    calls = []
    real, dense = MaskLoRALinear.forward, mask_adapter._dense_delta
    monkeypatch.setattr(MaskLoRALinear, "forward", lambda self, x: calls.append(1) or real(self, x))
    monkeypatch.setattr(mask_adapter, "_dense_delta", lambda *a: calls.append(2) or dense(*a))
    parent, adapted = (LLM(m) for m in _load_pair(ckpts, FORMATS[-1]))
    if adapted.model.decoder_path != "fused":
        pytest.skip("no fused decoder here (fbgemm missing)")
    ref = _gen(parent, temperature=0, block_size=1).token_ids
    calls.clear()
    assert _gen(adapted, temperature=0, block_size=1).token_ids == ref and not calls
    _gen(adapted, temperature=0, block_size=4, steps=4, speculative=False)
    assert calls


@pytest.mark.parametrize("k,out,r", [(576, 1536, 16), (576, 960, 48)])
def test_the_dense_delta_of_short_forwards_equals_the_gathered_one_bit_for_bit(k, out, r):
    """A forward of at most DENSE_DELTA_ROWS rows takes ``_dense_delta`` (the delta on every row, kept on the
    variant rows by ``torch.where``) instead of the gather/scatter of ``MaskLoRALinear.forward``: the variant rows
    get the same bits either way and every other row keeps the base output bit for bit (a causal row is the
    parent's)."""
    from unmask.engine.mask_adapter import DENSE_DELTA_ROWS, MaskAdapter, MaskLoRALinear

    g = torch.Generator().manual_seed(1)
    state = MaskAdapter.__new__(MaskAdapter)
    state.index = state.shape = state.row_mask = None
    layer = MaskLoRALinear(torch.nn.Linear(k, out, bias=False), torch.randn(r, k, generator=g) * 0.05,
                           torch.randn(out, r, generator=g) * 0.05, 2.0, state)
    run = layer.as_function()
    for shape in [(1, 4), (2, 5), (1, DENSE_DELTA_ROWS), (3, 7)]:
        x = torch.randn(*shape, k, generator=g)
        rows = torch.rand(shape, generator=g) < 0.5
        rows.view(-1)[0] = True
        with torch.inference_mode(), state.select(rows):
            dense_taken = state.row_mask is not None
            got, gathered, base = run(x), layer(x), layer.base(x)
        assert dense_taken == (rows.numel() <= DENSE_DELTA_ROWS), shape
        assert torch.equal(got, gathered), shape
        assert torch.equal(got[~rows], base[~rows]) and not torch.equal(got[rows], base[rows]), shape


def test_off_the_cpu_the_delta_is_two_gemms_without_gather_or_scatter(monkeypatch):
    """On a GPU (fake CUDA: CPU storage, a cuda tag) a forward of 40 rows, 23 of them variant rows, adds the delta in
    one GEMM per factor and a ``where``: no 16-row chunks (3 x 2 GEMMs on the CPU), no index_select/index_add, no
    indices copied to the device; the values match the CPU's chunked path to float32 rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from device_tags import FAKE, fake_cuda
    from unmask.engine.mask_adapter import MaskAdapter, MaskLoRALinear

    k, out, r = 64, 96, 8
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(r, k, generator=g) * 0.05, torch.randn(out, r, generator=g) * 0.05
    base = torch.nn.Linear(k, out, bias=False)
    x = torch.randn(2, 20, k, generator=g)
    rows = torch.rand(2, 20, generator=g) < 0.6

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def run(device):
        state = MaskAdapter.__new__(MaskAdapter)
        state.index = state.shape = state.row_mask = None
        lin = torch.nn.Linear(k, out, bias=False)
        lin.weight = torch.nn.Parameter(base.weight.detach().to(device), requires_grad=False)
        layer = MaskLoRALinear(lin, a.to(device), b.to(device), 2.0, state)
        xd, ops = x.to(device), Ops()
        with torch.inference_mode(), state.select(rows.to(device), host=rows):
            with ops:
                y = layer(xd)
        return y, ops.names

    cpu, cpu_ops = run(torch.device("cpu"))
    with fake_cuda(monkeypatch):
        gpu, gpu_ops = run(FAKE)
        assert gpu.device.type == "cuda"
        gpu = gpu.cpu()
    gemms = [n for n in gpu_ops if n in ("mm", "addmm", "linear", "matmul")]
    assert len(gemms) == 3, gpu_ops  # the base and one per factor
    assert not {"index_select", "index_add", "index_add_", "_to_copy", "copy_", "nonzero"} & set(gpu_ops), gpu_ops
    assert len([n for n in cpu_ops if n in ("mm", "addmm", "linear", "matmul")]) > 3  # the CPU keeps its chunks
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)
    assert torch.equal(gpu[~rows], cpu[~rows])  # the base rows are the base output, untouched
