"""Weight-only int8/int4 CPU linears (engine/lowbit.py, --weights int8|int4): error bounds against the float
weights, closeness of a model's logits to the float32 reference with explicit tolerances, batch invariance bit for
bit, the int8 export's own integers, and the fallback where a kernel cannot run."""
from __future__ import annotations

import pytest
import torch

import tiny
from unmask.engine import lowbit
from unmask.engine.lowbit import INT4_GROUP, LowbitLinear, quantize_int4, quantize_int8
from unmask.engine.packed_weights import pack_model, resolve_weight_format

pytestmark = pytest.mark.skipif(lowbit.lowbit_unavailable("int4", torch.device("cpu"), torch.float32) is not None
                                or lowbit.lowbit_unavailable("int8", torch.device("cpu"), torch.float32) is not None,
                                reason="no low-bit CPU kernels in this torch/CPU")

#: relative Frobenius error of the tiny random model's logits against float32 (Gaussian random weights are the
#: hard case for a 4-bit grid; observed int8 ~0.011, int4 ~0.11)
LOGIT_RTOL = {"int8": 0.03, "int4": 0.25}
#: a layer's output against x @ (its own dequantized weights).T: bf16 rounding of input and output only
KERNEL_RTOL = 2e-2


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def test_quantizers_respect_their_grids():
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and (w - q.float() * s[:, None]).abs().le(s[:, None] / 2 + 1e-6).all()
    q4, sz = quantize_int4(w)
    assert q4.min() >= 0 and q4.max() <= 15 and sz.shape == (96 // INT4_GROUP, 64, 2)
    scale, zero = sz[..., 0].T, sz[..., 1].T  # [out, groups]
    deq = ((q4.float().reshape(64, -1, INT4_GROUP) - 8) * scale[..., None] + zero[..., None]).reshape(64, 96)
    assert (w - deq).abs().le(scale.repeat_interleave(INT4_GROUP, 1) / 2 + 1e-5).all()
    with pytest.raises(ValueError, match="divisible"):
        quantize_int4(torch.randn(8, 40))


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_multiplies_by_its_quantized_weights(bits):
    torch.manual_seed(1)
    w, b, x = torch.randn(128, 64), torch.randn(128), torch.randn(5, 64)
    lin = LowbitLinear(w, b, bits)
    deq = lin.dequantized()
    assert _rel(x @ deq.T + b, lin(x)) < KERNEL_RTOL
    assert _rel(w, deq) < (0.01 if bits == 8 else 0.1)
    assert lin(x[None]).shape == (1, 5, 128) and lin(x).dtype == torch.float32


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_model_logits_close_and_batch_invariant(fmt):
    ref, lm = tiny.loaded(), tiny.loaded()
    pack_model(lm, fmt)
    assert lm.weight_format == fmt and lm.decoder_path == "fused"
    assert type(lm.model.get_output_embeddings()).__name__ == "LowbitLinear"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (8, 9), generator=g)
    pos = torch.arange(9)[None].expand(8, 9)
    with torch.no_grad():
        a = ref.logits(ref.hidden_states(ids, pos, None).reshape(-1, 64))
        full = lm.logits(lm.hidden_states(ids, pos, None).reshape(-1, 64)).reshape(8, 9, -1)
        assert _rel(a, full.reshape(a.shape)) < LOGIT_RTOL[fmt]
        # a row's logits do not depend on its batch mates (bit for bit): alone, in 3, in other company
        for rows in ([0], [0, 1, 2], [0, 5, 7, 3]):
            sub = lm.logits(lm.hidden_states(ids[rows], pos[rows], None).reshape(-1, 64)).reshape(len(rows), 9, -1)
            assert torch.equal(sub[0], full[0])


def test_int8_checkpoint_grid_runs_on_its_own_integers():
    # bitsandbytes' LLM.int8() export stores int8 rows with absmax/127 scales; re-quantizing its dequantized
    # weights (what pack_model sees) gives the same integers back
    torch.manual_seed(2)
    cb = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    cb[:, 0] = 127
    scb = torch.rand(32) + 0.5
    q, s = quantize_int8(cb.float() * (scb[:, None] / 127.0))
    assert torch.equal(q, cb) and torch.allclose(s, scb / 127.0)


def test_fallback_where_a_kernel_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="int4 cannot run here .*bfloat16"):
        assert resolve_weight_format("int4", cpu, torch.bfloat16) == "native"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.warns(RuntimeWarning, match="no vectorised ATen capability.*using fp16"):
        assert resolve_weight_format("int8", cpu) == "fp16"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(lowbit, "_has_aten_op", lambda name: name != "_weight_int4pack_mm_for_cpu")
    with pytest.warns(RuntimeWarning, match="no aten._weight_int4pack_mm_for_cpu"):
        assert resolve_weight_format("int4", cpu) == "fp16"
    assert resolve_weight_format("int8", cpu) == "int8"


def test_int4_holds_a_q4_1_gguf_block_grid_exactly():
    """A Q4_1 GGUF (the default model's parent) stores blocks of 32 weights as ``d * q + m`` (fp16 d and m, q in
    0..15 with both ends used: llama.cpp's ``quantize_row_q4_1``); min/max per group of 32 recovers d, m and every
    q, so ``--weights int4`` runs the GGUF's own integers: its only loss is the bf16 rounding of each group's scale
    and zero (docs/design.md section 13)."""
    torch.manual_seed(4)
    d = (torch.rand(48, 3) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(48, 3) * 0.1).half().float()
    q = torch.randint(0, 16, (48, 3, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15
    w = (d[..., None] * q + m[..., None]).reshape(48, 96)
    q4, sz = quantize_int4(w)
    assert torch.equal(q4.reshape(48, 3, INT4_GROUP), q)
    assert torch.equal(sz[..., 0].T, d)  # the scale is the block's d, bit for bit
    deq = ((q4.float().reshape(48, 3, INT4_GROUP) - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None])
    assert (deq.reshape(48, 96) - w).abs().max() <= 1e-6 * w.abs().max()
    assert _rel(w, LowbitLinear(w, None, 4).dequantized()) < 4e-3  # bf16 scale and zero only
