import sys; sys.path.insert(0, "tests")  # run from the repository root: python benchmarks/multi_block_tpf.py
from tiny import loaded
from unmask.engine import LLM, SamplingParams
llm = LLM(loaded())
for f in (None, 1.0, 0.75, 0.5, 0.25):
    o = llm.generate("Hello world", SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, multi_block=f))[0].outputs[0]
    print(f, "steps", o.steps, "nfe", o.nfe, "tpf", round(len(o.token_ids) / o.nfe, 3))
