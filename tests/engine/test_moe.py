"""The routed experts of ``engine/moe.py``: one ``grouped_mm`` per projection without a host read, equal to the
per-expert loop."""
from __future__ import annotations

import pytest
import torch

from unmask.engine.moe import GroupedExperts, MoeLayer, MoeSpec, grouped_mm_fits


def _experts(E: int, I: int, H: int, dtype=torch.float32, seed: int = 0) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    layer = GroupedExperts(MoeSpec(hidden=H, intermediate=I, num_experts=E, top_k=2))
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 7, 40])
def test_the_grouped_path_equals_the_per_expert_loop_to_rounding(dtype, N):
    """Experts with no rows included (8 experts, few tokens). Not bit for bit (the CPU kernel blocks its sums
    otherwise: why the CPU keeps the loop)."""
    E, I, H = 8, 24, 16
    layer = _experts(E, I, H, dtype)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, H, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)])
    weights = torch.rand(N, 2, generator=g)
    assert grouped_mm_fits(x, layer.gate_proj)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    order = torch.argsort(experts.reshape(-1), stable=True)
    rows = x.index_select(0, order // 2)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(layer._grouped(rows, counts), layer._looped(rows, counts.tolist()), **tol)
    assert layer(x, experts, weights).shape == (N, H)


def test_misaligned_shapes_take_the_loop():
    """A width whose rows are not a multiple of 16 bytes (5 float32s) is refused by the kernel: the loop runs."""
    layer = _experts(4, 5, 8)
    x = torch.randn(3, 8)
    assert not grouped_mm_fits(x, layer.gate_proj)
    out = layer(x, torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5))
    assert out.shape == (3, 8) and torch.isfinite(out).all()


def test_off_the_cpu_a_moe_layer_reads_nothing_on_the_host(monkeypatch):
    """Under fake CUDA (compute capability 9) a bf16 MoE layer (router, experts, shared expert) runs without a host
    read, a data-dependent shape or a blocking copy: the per-expert counts no longer reach the host (issue 42: at
    most one host sync per step); the values equal the CPU loop's to bf16 rounding. (float32 and fp16 keep the
    loop off the CPU: grouped_mm's kernel for them reads the host, tests/engine/test_break_it_moe.py.)"""
    from device_tags import FAKE, fake_cuda
    from sync_counter import SyncCounter

    spec = MoeSpec(hidden=16, intermediate=32, num_experts=8, top_k=2, shared_intermediate=32)
    layer = MoeLayer(spec).requires_grad_(False)  # as loaded for serving
    g = torch.Generator().manual_seed(1)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(2, 9, 16, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        cpu = layer(x)
    with fake_cuda(monkeypatch):
        layer.to(FAKE)
        xd = x.to(FAKE)
        with torch.inference_mode(), SyncCounter() as counter:  # as the engine runs it (views of parameters)
            out = layer(xd)
        assert out.device.type == "cuda"
        out = out.cpu()
    assert counter.total == 0, dict(counter.syncs)
    torch.testing.assert_close(out, cpu, rtol=2e-2, atol=2e-2)


def test_on_the_cpu_the_loop_runs(monkeypatch):
    """The CPU keeps the per-expert loop (its bits are the llada2 checks')."""
    layer = _experts(4, 16, 8)
    called = []
    monkeypatch.setattr(GroupedExperts, "_grouped", lambda *a: called.append(1))
    layer(torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5))
    assert not called
