"""Break-it tests of engine/moe.py's routed experts (issue 42/43): the grouped path off the CPU against the per-expert
loop, edge routings, and which devices and dtypes the grouped path may take.

``torch.nn.functional.grouped_mm`` has a kernel without a host read only for bfloat16 on compute capability 9.x /
10.x (torch's ``_grouped_mm_cuda``: ``bf16bf16_grouped_mm``); every other dtype or GPU runs its fallback, which
reads the offsets on the host (``offs.cpu()``) and loops over every group: three host reads per MoE layer where
the per-expert loop reads its counts once. :func:`torch_grouped_mm_rule` models that rule on fake CUDA.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_tags import FAKE, fake_cuda  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

from unmask.engine.moe import GroupedExperts, MoeLayer, MoeSpec  # noqa: E402


def _layer(E=8, I=32, H=16, k=2, dtype=torch.float32, shared=0, seed=0) -> MoeLayer:
    layer = MoeLayer(MoeSpec(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=shared))
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.2).to(dtype)
    return layer.requires_grad_(False)


def _reference(experts: GroupedExperts, x, idx, w):
    """Each token, each slot: ``w * down(silu(gate x) * up x)`` of its expert, summed in slot order (float64)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for n in range(x.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[n, s])
            xd = x[n].double()
            h = F.silu(experts.gate_proj[e].double() @ xd) * (experts.up_proj[e].double() @ xd)
            out[n] += float(w[n, s]) * (experts.down_proj[e].double() @ h)
    return out


@pytest.mark.parametrize("case", ["first-and-last-empty", "one-row", "top-k-is-E", "all-to-one", "no-rows"])
def test_the_experts_weigh_each_slot_of_each_token_by_its_own_weight(case):
    """Both paths (the loop; ``_grouped`` through the same sort) against a per-token float64 reference: empty
    first/last experts, a single row, every expert per token, every token to one expert, zero tokens."""
    E, I, H = 6, 32, 16
    k = E if case == "top-k-is-E" else 2
    layer = _layer(E, I, H, k)
    g = torch.Generator().manual_seed(3)
    N = {"one-row": 1, "no-rows": 0}.get(case, 5)
    x = torch.randn(N, H, generator=g)
    if case == "first-and-last-empty":
        idx = torch.stack([torch.randperm(E - 2, generator=g)[:2] + 1 for _ in range(N)])
    elif case == "top-k-is-E":
        idx = torch.stack([torch.randperm(E, generator=g) for _ in range(N)])
    elif case == "all-to-one":
        idx = torch.tensor([[3, 1]] * N)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)] or [torch.zeros(0, 2, dtype=torch.long)]).reshape(N, 2)
    w = torch.rand(N, k, generator=g)
    want = _reference(layer.experts, x, idx, w)
    looped = layer.experts(x, idx, w)
    torch.testing.assert_close(looped.double(), want, rtol=1e-5, atol=1e-6)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=E)
    torch.testing.assert_close(layer.experts._grouped(rows, counts), layer.experts._looped(rows, counts.tolist()),
                               rtol=1e-5, atol=1e-6)


def torch_grouped_mm_rule(monkeypatch, major: int) -> list:
    """``F.grouped_mm`` as torch's CUDA dispatch runs it on a GPU of compute capability ``major``: the kernel
    without a host read for bf16 on 9.x/10.x, else the fallback's ``offs.cpu()`` (a host read; recorded)."""
    real, fallbacks = F.grouped_mm, []

    def grouped_mm(a, b, *, offs=None, **kw):
        if not (a.dtype == b.dtype == torch.bfloat16 and major in (9, 10)):
            fallbacks.append(offs.cpu())  # torch's _grouped_mm_fallback reads the offsets on the host
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(F, "grouped_mm", grouped_mm)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(
        name="fake CUDA", total_memory=16 << 30, is_integrated=False, major=major, minor=0))
    return fallbacks


@pytest.mark.parametrize("dtype,major", [(torch.float32, 9), (torch.float16, 9), (torch.bfloat16, 8)],
                         ids=["float32-h100", "fp16-h100", "bf16-a100"])
def test_off_the_cpu_a_moe_layer_without_grouped_mms_kernel_reads_the_host_once(dtype, major, monkeypatch):
    """Where grouped_mm would fall back (float32/fp16, or bf16 before compute capability 9) the layer takes the
    per-expert loop: one host read (the counts), not one per projection (the fallback's three), same values."""
    layer = _layer(dtype=dtype, shared=32)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        cpu = layer(x)
    with fake_cuda(monkeypatch):
        fallbacks = torch_grouped_mm_rule(monkeypatch, major)
        layer.to(FAKE)
        xd = x.to(FAKE)
        with torch.inference_mode(), SyncCounter() as counter:
            out = layer(xd)
        out = out.cpu()
    assert not fallbacks, "grouped_mm ran its host-reading fallback"
    assert counter.syncs.get("host read", 0) <= 1, dict(counter.syncs)
    torch.testing.assert_close(out, cpu, rtol=0, atol=0)  # the loop: the CPU's own bits


def test_on_an_h100_bf16_takes_grouped_mm_with_no_host_read(monkeypatch):
    """bf16 on compute capability 9: the grouped kernel, nothing read on the host; values to bf16 rounding."""
    layer = _layer(dtype=torch.bfloat16, shared=32)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        cpu = layer(x)
    with fake_cuda(monkeypatch):
        fallbacks = torch_grouped_mm_rule(monkeypatch, 9)
        called = []
        grouped = GroupedExperts._grouped
        monkeypatch.setattr(GroupedExperts, "_grouped", lambda self, *a: called.append(1) or grouped(self, *a))
        layer.to(FAKE)
        xd = x.to(FAKE)
        with torch.inference_mode(), SyncCounter() as counter:
            out = layer(xd)
        out = out.cpu()
    assert called and not fallbacks and counter.total == 0, dict(counter.syncs)
    torch.testing.assert_close(out, cpu, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_llada2_decodes_the_cpu_tokens_under_fake_cuda(dtype, tmp_path, monkeypatch):
    """A tiny LLaDA2 (MoE) checkpoint loaded on fake CUDA (an H100's rule: float32 the loop, bf16 grouped_mm)
    gives the tokens it gives on the CPU in the same dtype."""
    from llada2_tiny import checkpoint_dir, loaded_llada2

    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model

    path = checkpoint_dir(loaded_llada2(seed=0), tmp_path / "llada2")
    params = SamplingParams(temperature=0, block_size=8, threshold=0.6, max_tokens=8, ignore_eos=True)
    prompts = ["a b c", "hello there", "x"]
    cpu = load_model(path, dtype=dtype, weights="native")  # the fake GPU's weights (the CPU default packs fp16)
    want = [o.outputs[0].token_ids for o in LLM(cpu, max_batch_size=4, enable_prefix_caching=False).generate(
        prompts, params)]
    with fake_cuda(monkeypatch):
        torch_grouped_mm_rule(monkeypatch, 9)
        llm = LLM(load_model(path, device="cuda", dtype=dtype), max_batch_size=4, enable_prefix_caching=False)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
