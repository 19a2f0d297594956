import json, sys, torch
sys.path.insert(0, "/work/main/benchmarks")
from bench_draft_head import grid_prompts
from unmask.engine import LLM, SamplingParams
torch.set_num_threads(2)
train = [json.loads(l)["prompt"] for l in open("/work/runs/head1/distill_snapshot.jsonl")][:6]
CK = sys.argv[1]
for w in ("auto",):
    llm = LLM(CK, weights=w)
    for name, ps in (("grid", grid_prompts(12)), ("train", train)):
        tok = nfe = acc = prop = 0
        for p in ps:
            ids = llm.apply_chat_template([{"role": "user", "content": p}])
            seq = llm.make_sequences(ids, SamplingParams(max_tokens=64, temperature=0, block_size=5, speculative=True), "r")[0]
            while not seq.finished:
                llm.denoiser.step([seq])
            tok += seq.final_len - seq.prompt_len; nfe += seq.nfe; acc += seq.accepted_drafts; prop += seq.proposed_drafts
        print(w, name, "TPF %.2f" % (tok / nfe), "accepted/proposed %.3f" % (acc / prop), "tokens", tok, flush=True)
