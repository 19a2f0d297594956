"""benchmarks/reference_loop.py (issue 42's frozen reference) decodes the engine's tokens: greedy, same model, same
settings, batch of 3, quota and threshold, cache none and Fast-dLLM's prefix cache."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import tiny  # noqa: E402


def _reference():
    spec = importlib.util.spec_from_file_location("reference_loop", ROOT / "benchmarks" / "reference_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("attention, caches", [("prefix_causal", ("none",)), ("bidirectional", ("none", "prefix"))])
def test_reference_equals_engine(attention, caches):
    from unmask.engine import LLM, SamplingParams

    ref = _reference()
    kw = {} if attention == "prefix_causal" else {"logit_shift": False}
    model = tiny.loaded(attention=attention, block_size=4, initializer_range=0.2, **kw)
    llm = LLM(model)
    prompts = torch.randint(3, 300, (3, 6), generator=torch.Generator().manual_seed(1))
    for cache in caches:
        for steps, threshold in ((5, None), (None, 0.5)):
            cfg = ref.ReferenceConfig(max_tokens=10, block_size=4, steps=steps, threshold=threshold, cache=cache)
            params = SamplingParams.from_flat(temperature=0, speculative=False, block_size=4, steps=steps,
                                              threshold=threshold, cache=cache, ignore_eos=True, max_tokens=10)
            engine = [o.outputs[0].token_ids for o in llm.generate(prompts.tolist(), params)]
            assert ref.reference_generate(model, prompts, cfg).tolist() == engine, (cache, steps, threshold)


def test_reference_refuses_what_it_does_not_implement():
    ref = _reference()
    model = tiny.loaded(attention="prefix_causal", block_size=4)
    with pytest.raises(ValueError, match="cache"):
        ref.reference_generate(model, torch.ones(1, 3, dtype=torch.long), ref.ReferenceConfig(4, 4, cache="prefix"))
    with pytest.raises(ValueError, match="max_tokens"):
        ref.reference_generate(model, torch.ones(1, 3, dtype=torch.long), ref.ReferenceConfig(4096, 4))
