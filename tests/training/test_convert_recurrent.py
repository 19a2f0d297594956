"""A parent with recurrent (Gated DeltaNet / Mamba-style) layers is refused by `unmask convert` with the reason
(docs/big-model.md, "Gated DeltaNet layers and A2D"); softmax-attention layer types convert as before."""
from __future__ import annotations

import pytest

from tiny import make_llama, make_tokenizer
from unmask.training.convert import ConversionError, check_softmax_layers, convert_model


def test_recurrent_layers_are_refused_naming_them(tmp_path):
    tok = make_tokenizer()
    model = make_llama(len(tok))
    model.config.layer_types = ["linear_attention", "full_attention"]  # Qwen3-Next / Qwen3.5's naming
    with pytest.raises(ConversionError, match=r"SRC: 1 of 2 layers are recurrent \(linear_attention\)"):
        convert_model(model, tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    model.config.layer_types = ["mamba", "attention"]
    with pytest.raises(ConversionError, match=r"recurrent \(mamba\)"):
        check_softmax_layers(model.config)


def test_softmax_layer_types_pass():
    tok = make_tokenizer()
    model = make_llama(len(tok))
    for types in (None, ["full_attention", "sliding_attention"]):
        model.config.layer_types = types
        check_softmax_layers(model.config)
