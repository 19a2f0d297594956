"""Start-up memory of a loaded checkpoint (docs/design.md#mask-row-adapter, "Memory at start-up"): the weights are read
into the process's own memory (no memory map of the safetensors file stays alive: its pages counted in RSS beside
the packed weights made from them), with the same values transformers' own loading gives, and the mask-row
adapter's state keeps no second copy of the adapter's tensors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiny
from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.model import load_model


def _mapped(file: Path) -> bool:
    """Whether this process has ``file`` memory-mapped (``/proc/self/maps``)."""
    target = str(file.resolve())
    return any(line.rstrip().endswith(target) for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load_memory")
    m = tiny.loaded(initializer_range=0.5)
    write_checkpoint(tmp / "parent", m.model, m.tokenizer, m.dllm)
    write_adapter(tmp / "adapter", tiny.random_adapter_weights(m),
                  {"sha256": parent_hash(tmp / "parent"), "name": str(tmp / "parent")})
    return tmp


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize("weights", ["native", "auto"])
def test_loaded_weights_are_not_a_map_of_the_file_and_equal_transformers_own_load(ckpt, weights):
    from transformers import AutoModelForCausalLM, GenerationConfig

    file = ckpt / "parent" / "model.safetensors"
    loaded = load_model(ckpt / "parent", weights=weights)
    assert not _mapped(file), "the safetensors file stays memory-mapped after loading"
    if weights != "native":
        return
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt / "parent"), dtype=torch.float32)
    got, want = loaded.model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (loaded.model.get_output_embeddings().weight is loaded.model.get_input_embeddings().weight) == \
        (ref.get_output_embeddings().weight is ref.get_input_embeddings().weight)
    assert loaded.model.generation_config.to_dict() == GenerationConfig.from_pretrained(str(ckpt / "parent")).to_dict()


def test_the_adapter_state_keeps_no_copy_of_the_tensors(ckpt):
    loaded = load_model(ckpt / "adapter", weights="native")
    state = loaded.row_variant
    assert state.weights.layers == {} and state.weights.mask_embedding is None
    assert state.weights.rank == loaded.adapter["rank"]
