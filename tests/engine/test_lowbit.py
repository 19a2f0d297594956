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


def _batch(seed: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [rows, cols] (generator ``seed``) and their positions 0..cols-1."""
    ids = torch.randint(0, 300, (rows, cols), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(cols)[None].expand(rows, cols)


def _logits(m, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``m``'s logits [rows, cols, V] of a batch (no attention mask; the tiny model's width 64)."""
    return m.logits(m.hidden_states(ids, pos, None).reshape(-1, 64)).reshape(*ids.shape, -1)


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
    ids, pos = _batch(3, 8, 9)
    with torch.no_grad():
        a, full = _logits(ref, ids, pos), _logits(lm, ids, pos)
        assert _rel(a, full.reshape(a.shape)) < LOGIT_RTOL[fmt]
        # a row's logits do not depend on its batch mates (bit for bit): alone, in 3, in other company
        for rows in ([0], [0, 1, 2], [0, 5, 7, 3]):
            sub = _logits(lm, ids[rows], pos[rows])
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


def test_on_int4_grid_is_exact():
    torch.manual_seed(4)
    w = torch.randn(48, 96)
    assert not lowbit.on_int4_grid(w)  # float weights
    snapped = tiny.int4_grid(w)
    assert lowbit.on_int4_grid(snapped)
    # Q4_1 blocks written out as llama.cpp does: d * q + m (fp16 d and m), q in 0..15 with both ends used
    d = (torch.rand(48, 3) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(48, 3) * 0.1).half().float()
    q = torch.randint(0, 16, (48, 3, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15
    assert lowbit.on_int4_grid((d[..., None] * q + m[..., None]).reshape(48, 96))
    moved = snapped.clone()
    moved[7, 40] += 1e-3  # one weight off its grid point by ~0.4% of a step (the steps are ~0.27 here)
    assert not lowbit.on_int4_grid(moved)
    assert not lowbit.on_int4_grid(torch.randn(8, 40))  # in_features not a multiple of the group
    # on the grid, int4 multiplies by the same weights up to the bf16 rounding of scale and zero
    lin = LowbitLinear(snapped, None, 4)
    assert _rel(snapped, lin.dequantized()) < 2e-2


def test_auto_runs_4bit_grid_weights_as_int4_and_the_rest_fp16():
    ref = tiny.snap_decoder_to_int4_grid(tiny.loaded(vocab_size=320))
    lm = tiny.snap_decoder_to_int4_grid(tiny.loaded(vocab_size=320))
    pack_model(lm, "auto")
    assert lm.weight_format == "int4" and lm.decoder_path == "fused"
    n_layers = len(lm.model.base_model.layers)
    assert lm.packed_layers == {"int4": 4 * n_layers, "fp16": 1}  # q|k|v, o, gate|up, down; the head off the grid
    assert type(lm.model.get_output_embeddings()).__name__ == "PackedFp16Linear"
    ids, pos = _batch(5, 6, 7)
    with torch.no_grad():
        a, full = _logits(ref, ids, pos), _logits(lm, ids, pos)
        # only bf16 rounding (activations, scales, outputs) separates them: far inside explicit int4's 0.25
        assert _rel(a, full.reshape(a.shape)) < 0.03
        for rows in ([0], [0, 4, 2]):
            sub = _logits(lm, ids[rows], pos[rows])
            assert torch.equal(sub[0], full[0])
    # float weights keep auto's fp16 packing; an explicit format is taken as asked
    plain = tiny.loaded()
    pack_model(plain, "auto")
    assert plain.weight_format == "fp16" and plain.packed_layers == {"fp16": 4 * n_layers + 1}
    forced = tiny.snap_decoder_to_int4_grid(tiny.loaded())
    pack_model(forced, "fp16")
    assert forced.weight_format == "fp16"
