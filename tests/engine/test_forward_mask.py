"""``lane_masks.forward_mask``: the all-true mask it makes without the keys' metadata (every row real and seeing every
key of its lane) is the mask ``build_attention_mask`` gives, on every forward of the cache modes and attentions."""
from __future__ import annotations

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine import lane_masks
from unmask.engine.attention import build_attention_mask
from unmask.engine.lane_attention import use_lanes


@pytest.mark.parametrize("attention,cache", [("bidirectional", "prefix"), ("bidirectional", "none"),
                                             ("bidirectional", "dual"), ("prefix_causal", "auto")])
def test_the_shortcut_mask_is_the_built_mask(monkeypatch, attention, cache):
    seen = {"forwards": 0, "all_true": 0}
    original = lane_masks.forward_mask

    def checked(kv, pos, grp, start, committed, valid):
        mask = original(kv, pos, grp, start, committed, valid)
        c_pos, c_grp, c_valid = kv.key_meta()
        built = build_attention_mask(q_pos=pos, q_grp=grp, q_start=start, q_valid=valid,
                                     k_pos=torch.cat([c_pos, pos], 1), k_grp=torch.cat([c_grp, grp], 1),
                                     k_committed=torch.cat([c_valid, committed], 1),
                                     k_valid=torch.cat([c_valid, valid], 1))
        assert torch.equal(mask, built)
        seen["forwards"] += 1
        seen["all_true"] += bool(built.all())
        return mask

    monkeypatch.setattr(lane_masks, "forward_mask", checked)
    model = tiny.loaded(attention=attention, logit_shift=attention != "bidirectional", block_size=4)
    use_lanes(model)  # as load_model does: the lanes' attention (the shortcut is taken in lane mode only)
    llm = LLM(model, max_batch_size=8)
    params = SamplingParams.from_flat(temperature=0, max_tokens=12, block_size=4, cache=cache, ignore_eos=True)
    for prompts in ([[1, 2, 3], [4, 5, 6], [9, 10, 11]], [[1, 2, 3], [4, 5, 6, 7, 8]]):  # equal widths; padded
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert seen["forwards"] > 0 and model.lane_attention
    if attention == "bidirectional":
        assert seen["all_true"] > 0  # the shortcut's case occurs
