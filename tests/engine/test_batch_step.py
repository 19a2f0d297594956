"""The batched reveal pass (engine/batch_step.py), the counter-based draws (engine/noise.py) and the host reads of a
batch step (docs/design.md#devices, issue 42)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decoding_paths as dp  # noqa: E402
import tiny  # noqa: E402
from device_tags import fake_cuda  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

from unmask.engine import LLM, SamplingParams  # noqa: E402
from unmask.engine import denoiser as denoiser_module  # noqa: E402
from unmask.engine.noise import GUMBEL, REMASK, Draws, row_keys, uniform  # noqa: E402
from unmask.engine.reveal_rule import select_segments  # noqa: E402
from unmask.engine.sampler import Candidates, RowGroup, sample_groups  # noqa: E402

#: one request of each kind the batched pass serves, decoded together (and a constrained one beside them, which
#: takes its own path in the same forwards)
MIXED = [
    dict(temperature=0, block_size=4),
    dict(temperature=0, block_size=4, threshold=0.3),
    dict(temperature=0.9, seed=5, block_size=4, top_k=20, top_p=0.9),
    dict(temperature=0.7, seed=6, block_size=4, remasking="random", steps=6),
    dict(temperature=0, block_size=4, remasking="margin"),
    dict(temperature=0, block_size=4, remasking="entropy"),
    dict(temperature=0, block_size=4, remasking="left_to_right", threshold=0.5),
    dict(temperature=0, block_size=4, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    dict(temperature=0, block_size=4, logit_bias={5: 5.0, 6: -100.0}, min_tokens=4, logprobs=True, top_logprobs=3),
    dict(temperature=0, block_size=4, multi_block=0.5),
    dict(temperature=0, block_size=8, sub_block_size=4),
]


def _decode(llm: LLM, requests: list[dict]) -> list[list]:
    """Every request's events (block, step, revealed positions/tokens/logprobs in reveal order), decoded together
    by a fresh engine over ``llm``'s model (its own prefix cache: a prompt another call cached is not loaded, so
    two calls forward the same rows)."""
    engine = LLM(llm.model)._engine(16)
    tok = llm.tokenizer
    ids = {}
    for i, kw in enumerate(requests):
        kw = dict(kw)
        prompt = dp.PROMPTS[kw.pop("prompt", i) % len(dp.PROMPTS)]
        params = SamplingParams.from_flat(**dict({"speculative": False}, **kw, max_tokens=10, ignore_eos=True))
        for r in engine.add_request(tok(prompt).input_ids, params, f"r{i}"):
            ids[r.request_id] = i
    events = [[] for _ in requests]
    while engine.has_unfinished():
        for ev in engine.step():
            events[ids[ev.request_id]].append((ev.block, ev.step, [(r.position, r.token_id, r.logprob, r.top)
                                                                    for r in ev.revealed], ev.finished))
    return events


@pytest.fixture(scope="module")
def causal_llm():
    return LLM(tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5), max_batch_size=16)


def test_the_batched_pass_reveals_what_each_sequences_own_consume_does(causal_llm, monkeypatch):
    """A mixed batch through the one batched pass gives every request the events (same reveals, same order, same
    log-probabilities) it gets when each sequence consumes its own rows (``Sequence.consume``)."""
    batched = _decode(causal_llm, MIXED)
    monkeypatch.setattr(denoiser_module, "batchable", lambda seq: False)
    one_by_one = _decode(causal_llm, MIXED)
    for i, (a, b) in enumerate(zip(batched, one_by_one)):
        assert a == b, MIXED[i]


def test_cfg_requests_batched_together_equal_their_own_consume(monkeypatch):
    llm = LLM(tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4, initializer_range=0.5))
    reqs = [dict(temperature=0, block_size=4, cfg_scale=s, cache="none") for s in (0.5, 1.0, 2.0)]
    batched = _decode(llm, reqs)
    monkeypatch.setattr(denoiser_module, "batchable", lambda seq: False)
    assert batched == _decode(llm, reqs)


def test_a_sampled_request_draws_the_same_alone_and_in_any_batch(causal_llm):
    """Counter-based draws: a seeded sampled request's tokens do not depend on its batch mates (their number, their
    rows) — with a generator consumed in call order they would."""
    sampled = dict(temperature=1.0, seed=11, block_size=4, top_p=0.95, prompt=1)
    alone = _decode(causal_llm, [sampled])[0]
    mates = [dict(temperature=0.8, seed=s, block_size=4) for s in range(5)]
    assert _decode(causal_llm, mates[:2] + [sampled] + mates[2:])[2] == alone


def test_draws_depend_only_on_the_key_and_the_column():
    keys = row_keys(7, 3, GUMBEL, [10, 11, 12, 13])
    u = uniform(keys, 50, "cpu")
    assert torch.equal(uniform(keys[2:3], 50, "cpu"), u[2:3])  # a row alone = the row in a batch
    assert torch.equal(uniform(keys, 20, "cpu"), u[:, :20])  # a column does not depend on the width
    assert not torch.equal(row_keys(7, 3, REMASK, [10]), row_keys(7, 3, GUMBEL, [10]))  # streams differ
    assert not torch.equal(row_keys(7, 4, GUMBEL, [10]), keys[:1])  # steps differ
    assert Draws(7, 3, [10, 11, 12, 13]).at([2]).keys(GUMBEL, 1).tolist() == keys[2:3].tolist()


def test_draws_are_uniform_and_independent_enough_for_sampling():
    """First and second moments, neighbouring columns and rows: a biased or correlated hash fails these."""
    u = uniform(row_keys(1, 0, GUMBEL, range(64)), 4096, "cpu")
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    x = u - 0.5
    assert abs(float((x[:, 1:] * x[:, :-1]).mean()) * 12) < 0.01  # neighbouring columns
    assert abs(float((x[1:] * x[:-1]).mean()) * 12) < 0.01  # neighbouring rows (consecutive positions)
    counts = torch.histc(u.flatten().float(), bins=64, min=0, max=1)
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 120  # chi-square, 63 dof (p ~ 1e-5)


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    params = SamplingParams(temperature=1.0, seed=0)
    hits = torch.zeros(4)
    for step in range(1500):
        c = sample_groups(logits.clone(), [RowGroup(0, 1, params, Draws(0, step, [3]))])
        hits[int(c.tokens[0])] += 1
    assert (hits / 1500 - p).abs().max() < 0.05  # ~4 sigma


def test_select_segments_applies_each_segments_rule():
    score = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.8, 0.2, 0.95], dtype=torch.float64)
    prob = score.clone()
    cands = Candidates(torch.arange(7), prob, score, prob.float())
    chosen = select_segments(cands, [(0, 3, 2, None), (3, 6, None, 0.7), (6, 7, None, 0.99)])
    # quota 2 of rows 0-2 (0.9, 0.5); threshold 0.7 in 3-5 (0.8); threshold 0.99 in row 6: the best one anyway
    assert chosen.tolist() == [False, True, True, False, True, False, True]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("paths"))


@pytest.mark.parametrize("name", ["quota", "threshold", "multi-block", "cfg", "adapter-plain", "llada2-refinement",
                                  "llada2-editing"])
def test_a_batch_step_reads_the_host_at_most_once(name, checkpoints, monkeypatch):
    """Under fake CUDA, a step of 8 plain / threshold / multi-block / CFG / mask-row adapter / block-refinement
    requests makes at most one host read (the step's summary), no value read, no data-dependent shape, no boolean-mask index and no blocking
    copy (the adapter's rows are indexed from the host's flags)."""
    from unmask.engine.denoiser import Denoiser
    from unmask.engine.model import LoadedModel, load_model

    path = next(p for p in dp.PATHS if p.name == name)
    with fake_cuda(monkeypatch):
        llm = LLM(load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32"), max_batch_size=8)
        params = SamplingParams.from_flat(**dict(path.params, max_tokens=8, ignore_eos=True))
        prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(8)]
        with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                c.step_method(Denoiser, "step"):
            llm.generate(prompts, params)
    assert c.steps
    for s in c.steps:  # an MoE forward (llada2) reads its expert counts: the model's, not the step's
        outside = {k: v - s["forward_syncs"].get(k, 0) for k, v in s["syncs"].items()}
        assert outside.get("host read", 0) <= 1 and set(outside) <= {"host read"}, s


def test_refinement_requests_refined_together_equal_their_own_consume(monkeypatch):
    """The block-refinement pass over many sequences (``unmask.engine.refinement.refine_batch``) gives each the
    events its own ``consume`` gives in the same forwards: greedy and sampled, with and without editing, top-k,
    ``logit_bias``, ``min_tokens`` and ``top_logprobs``."""
    from llada2_tiny import loaded_llada2

    llm = LLM(loaded_llada2(seed=1))
    # each prompt at one block size
    reqs = [dict(temperature=0, block_size=8, threshold=0.7, prompt=0),
            dict(temperature=0, block_size=8, threshold=0.5, editing_threshold=0.4, logprobs=True, top_logprobs=2,
                 prompt=0),
            dict(temperature=0.9, seed=4, block_size=8, top_k=30, threshold=0.6, editing_threshold=0.3, prompt=0),
            dict(temperature=0.7, seed=5, block_size=4, steps=6, logit_bias={9: 2.0}, min_tokens=3, prompt=1),
            dict(temperature=0, block_size=4, threshold=0.9, top_p=0.8, prompt=2)]
    together = _decode(llm, reqs)
    monkeypatch.setattr(denoiser_module, "batchable", lambda seq: False)
    assert _decode(llm, reqs) == together


#: speculative requests of every verification rule, decoded together (issue 42: one verification pass per step)
SPECULATIVE = [
    dict(temperature=0, block_size=4, speculative=True, logprobs=True, top_logprobs=3),
    dict(temperature=0, block_size=3, speculative=True, speculative_branches=1, min_tokens=5),
    dict(temperature=0, block_size=4, speculative=True, speculative_ratio=0.3),
    dict(temperature=0, block_size=4, speculative=True, speculative_epsilon=0.05, logit_bias={5: 3.0, 7: -100.0}),
    dict(temperature=0.8, seed=3, block_size=4, speculative=True, logprobs=True, top_logprobs=2),
    dict(temperature=1.0, seed=4, block_size=3, speculative=True, top_k=20, top_p=0.9),
    dict(temperature=0, block_size=4),
]


def test_speculative_requests_verified_together_equal_their_own_consume(causal_llm, monkeypatch):
    """The verification pass over many speculative sequences (``unmask.engine.speculative_batch``) gives each the
    events (tokens, log-probabilities, alternatives, in order) that its own ``consume`` gives in the same forwards
    (greedy, relaxed rules, speculative sampling, ``min_tokens``, ``logit_bias``, a plain request beside), and the
    tokens it gets decoded alone."""
    together = _decode(causal_llm, SPECULATIVE)
    for i, req in enumerate(SPECULATIVE):
        alone = _decode(causal_llm, [dict(req, prompt=i)])[0]
        assert [[r[:2] for r in e[2]] for e in alone] == [[r[:2] for r in e[2]] for e in together[i]], req
    monkeypatch.setattr(denoiser_module, "batchable", lambda seq: False)
    assert _decode(causal_llm, SPECULATIVE) == together


@pytest.mark.parametrize("name, batch", [("speculative-greedy", 1), ("speculative-greedy", 8),
                                         ("speculative-greedy", 32), ("speculative-sampled", 8)])
def test_a_speculative_batch_step_reads_the_host_at_most_twice(name, batch, checkpoints, monkeypatch):
    """Under fake CUDA a step of 1, 8 or 32 speculative requests reads the host at most twice (issue 42's bound;
    the verification pass copies once), with no value read, data-dependent shape, boolean-mask index or blocking
    copy: verification per request read its argmax and acceptance (3 syncs a request-step, 96 at batch 32)."""
    from unmask.engine.denoiser import Denoiser
    from unmask.engine.model import LoadedModel, load_model

    path = next(p for p in dp.PATHS if p.name == name)
    with fake_cuda(monkeypatch):
        llm = LLM(load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32"), max_batch_size=batch)
        params = SamplingParams.from_flat(**dict(path.params, max_tokens=6, ignore_eos=True))
        prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(batch)]
        with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                c.step_method(Denoiser, "step"):
            llm.generate(prompts, params)
    assert c.steps
    for s in c.steps:
        assert s["syncs"].get("host read", 0) <= 2 and set(s["syncs"]) <= {"host read"}, s["syncs"]


def test_the_post_forward_step_traces_without_graph_breaks():
    """Sampling, scores and the reveal rule over a batch compile as one graph (``fullgraph=True``; dynamo's
    tracing only, no inductor: tens of seconds per shape on 2 cores)."""
    torch._dynamo.reset()
    greedy = SamplingParams(temperature=0.0, seed=0)
    sampled = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, remasking="margin")
    groups = [RowGroup(0, 3, greedy, Draws(0, 0, [5, 6, 7])), RowGroup(3, 5, sampled, Draws(1, 2, [9, 10]))]
    segments = [(0, 3, 2, None), (3, 5, None, 0.5)]

    def step(logits):
        cands = sample_groups(logits, groups)
        return cands.tokens, select_segments(cands, segments)

    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    want = step(logits.clone())
    got = torch.compile(step, fullgraph=True, backend="eager")(logits.clone())
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_a_batched_step_attends_to_views_of_each_lanes_cache_not_copies(checkpoints, monkeypatch):
    """Lane attention (engine/lane_attention.py): in a batch of decoding lanes each lane's keys are views of its own
    blocks in the KV pool (engine/kv_pool.py; its new rows written after the cached ones), never a padded copy of
    every lane's cache; the tokens equal the padded-copy attention's (transformers' SDPA over one [B, H, C + Q, D]
    tensor)."""
    from unmask.engine.kv_cache import BatchKV
    from unmask.engine.model import load_model

    path = next(p for p in dp.PATHS if p.name == "quota")
    model = load_model(checkpoints[path.checkpoint], weights="native")
    assert model.lane_attention
    seen = {"views": 0, "copies": 0}
    lane_segments = BatchKV.lane_segments

    def spy(self, b, layer, key, value):
        segments, n = lane_segments(self, b, layer, key, value)
        lane = self.lanes[b]
        if n:  # a lane with cached keys: views of the pool's storage, or a copy
            pool = lane.pool
            storage = {pool.storage(pool.slab_of(blk), layer)[0].untyped_storage().data_ptr() for blk in lane.table}
            for k, _ in segments[:-1] if b not in self._written.get(layer, ()) else segments:
                seen["views" if k.untyped_storage().data_ptr() in storage else "copies"] += 1
        return segments, n

    monkeypatch.setattr(BatchKV, "lane_segments", spy)
    lanes = dp.run_path(LLM(model, max_batch_size=8), path)
    assert seen["views"] > 0 and seen["copies"] == 0, seen
    monkeypatch.undo()
    padded = load_model(checkpoints[path.checkpoint], weights="native")
    padded.model.set_attn_implementation("sdpa")
    padded.lane_attention = False
    assert dp.run_path(LLM(padded, max_batch_size=8), path) == lanes
