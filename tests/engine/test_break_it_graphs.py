"""Break-it tests of the static post-forward step and its CUDA graphs (engine/step_graphs.py, engine/buckets.py;
docs/design.md#decoding, "Static shapes and CUDA graphs"): ladder edges, batches that change between replays of one
bucket, non-finite rows, odd vocabularies, half-precision logits, batch invariance through the static step, and the
option refused off CUDA. The capture runs against test_step_graphs' fake graph API (a replay re-runs the recorded ops
on the captured tensors, so a value baked in at capture shows as a wrong result)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decoding_paths as dp  # noqa: E402
import tiny  # noqa: E402
from test_step_graphs import KINDS, _eager, _groups, fake_cuda_graphs  # noqa: E402,F401

from unmask.engine import LLM, SamplingParams  # noqa: E402
from unmask.engine import step_graphs as sg  # noqa: E402
from unmask.engine.buckets import ROW_BUCKETS, SEGMENT_BUCKETS, WIDTH_BUCKETS  # noqa: E402
from unmask.engine.noise import Draws  # noqa: E402
from unmask.engine.sampler import RowGroup  # noqa: E402


def _same(a, b, nan_ok=False) -> None:
    (ca, cha), (cb, chb) = a, b
    for field in ("tokens", "probability", "score", "logprob"):
        x, y = getattr(ca, field), getattr(cb, field)
        assert x.dtype == y.dtype and x.shape == y.shape, field
        assert torch.equal(x, y) or (nan_ok and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)), (field, x, y)
    assert torch.equal(cha, chb), (cha, chb)


def _uniform_batch(n_groups: int, rows: int, V: int, seed: int = 0, **kw):
    """``n_groups`` groups of ``rows`` rows each (one segment each), parameters cycling through sampled and
    greedy, quota and threshold; ``[n_groups * rows, V]`` logits."""
    gen = torch.Generator().manual_seed(seed)
    groups, segments = [], []
    for i in range(n_groups):
        lo = i * rows
        params = SamplingParams(seed=i, temperature=0.8 if i % 2 else 0.0, **kw)
        groups.append(RowGroup(lo, lo + rows, params, Draws(i, 3, list(range(5, 5 + rows)))))
        segments.append((lo, lo + rows, None, 0.4) if i % 3 == 0 else (lo, lo + rows, 2, None))
    return groups, segments, torch.randn(n_groups * rows, V, generator=gen) * 3


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 12, 13, 24, 25, ROW_BUCKETS[-1]])
def test_rows_at_and_just_above_a_rung_give_the_eager_result(rows):
    """Row counts on a rung, one above it, and the top rung itself: bucketed to the rung expected, results equal."""
    groups, segments, logits = _uniform_batch(1, rows, 11) if rows < 64 else _uniform_batch(rows // 64, 64, 11)
    graphs = sg.StepGraphs("cpu")
    _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert graphs.stats["static_steps"] == 1
    (key,) = graphs._inputs
    assert key[0] == next(r for r in ROW_BUCKETS if r >= rows)


def test_past_every_ladders_top_the_step_runs_eagerly_and_equal():
    """One row past the top rung of rows, one segment past the segment ladder, one column past the width ladder:
    the eager pass, counted by reason, same results."""
    graphs = sg.StepGraphs("cpu")
    cases = {"rows": _uniform_batch(ROW_BUCKETS[-1] // 64 + 1, 64, 5),
             "segments": _uniform_batch(SEGMENT_BUCKETS[-1] + 1, 1, 5),
             "width": _uniform_batch(1, WIDTH_BUCKETS[-1] + 1, 5)}
    for reason, (groups, segments, logits) in cases.items():
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
        assert graphs.stats[f"eager:{reason}"] == 1, (reason, graphs.stats)
    at_top = {"segments": _uniform_batch(SEGMENT_BUCKETS[-1], 1, 5), "width": _uniform_batch(1, WIDTH_BUCKETS[-1], 5)}
    for groups, segments, logits in at_top.values():
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert graphs.stats["static_steps"] == 2


def _mixed(seed: int, layout: list[int]):
    """Groups of :data:`KINDS`' parameters in the order ``layout`` (indices into KINDS, repeats allowed), rows and
    rules as there, with distinct seeds and positions per entry."""
    gen = torch.Generator().manual_seed(seed)
    groups, segments, lo = [], [], 0
    for j, i in enumerate(layout):
        kw, n, (quota, threshold) = KINDS[i]
        params = SamplingParams(seed=seed * 100 + j, **kw)
        extra = {}
        if kw.get("min_tokens"):
            extra = dict(min_tokens_rows=torch.tensor([True, False]), min_tokens_ids=torch.tensor([1, 2]),
                         context_ids=torch.tensor([3, 3, 7]), bias=(torch.tensor([4, 9]), torch.tensor([2.0, -1.0])))
        groups.append(RowGroup(lo, lo + n, params, Draws(seed * 100 + j, seed + j, list(range(30 + lo, 30 + lo + n))),
                               left_to_right_base=j + seed, **extra))
        segments.append((lo, lo + n, quota, threshold))
        lo += n
    return groups, segments, torch.randn(lo, 48, generator=gen) * 3


def test_one_bucket_replayed_for_batches_whose_members_change(fake_cuda_graphs):
    """The same graph (same bucket and parts) replayed while requests join, leave and change places: rows of a
    sampled top-k request where a greedy one was at capture, thresholds on other segments, fewer real rows (more
    padding), other left-to-right bases and seeds. Every replay equals the eager pass on its own values."""
    graphs = sg.StepGraphs("cpu", capture=True, warmup=1)
    layouts = [[0, 1, 2, 3, 4, 5, 6],  # 13 rows, captured
               [6, 5, 4, 3, 2, 1, 0],  # the same requests in reverse order
               [1, 1, 2, 3, 4, 5, 6],  # the greedy one left, a second sampled top-k/top-p one joined
               [1, 2, 3, 4, 5, 6, 6],  # 13 rows, other segments under a threshold
               [1, 2, 3, 4, 0, 0, 0],  # 9 rows (7 padding), still every part
               [4, 3, 2, 1, 6]]        # 9 rows, 5 segments (8 bucketed)
    shapes = set()
    for seed, layout in enumerate(layouts):
        groups, segments, logits = _mixed(seed, layout)
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
        shape, _, _ = sg.step_tables(groups, segments, logits.shape[0], 48)
        shapes.add(shape)
    assert graphs.stats["captures"] == len(shapes) < len(layouts)
    assert graphs.stats["graph_steps"] == len(layouts)


def test_a_request_gets_the_same_results_alone_and_inside_a_batch_through_the_static_step():
    """Batch invariance through the static step: each request's rows, candidates and reveals alone (a small bucket,
    its own top-k width) equal its rows inside the mixed batch (a larger bucket, the batch's widest top-k)."""
    groups, segments, logits = _mixed(7, [0, 1, 2, 3, 4, 5, 6, 1, 2])
    batch = sg.StepGraphs("cpu").sample_and_select(logits.clone(), groups, segments)
    for g, (lo, hi, q, t) in zip(groups, segments):
        alone_group = RowGroup(0, g.n, g.params, g.draws, g.min_tokens_rows, g.min_tokens_ids, g.context_ids, g.bias,
                               g.left_to_right_base)
        cands, chosen = sg.StepGraphs("cpu").sample_and_select(logits[lo:hi].clone(), [alone_group],
                                                               [(0, hi - lo, q, t)])
        for field in ("tokens", "probability", "score", "logprob"):
            assert torch.equal(getattr(cands, field), getattr(batch[0], field)[lo:hi]), (field, g.params)
        assert torch.equal(chosen, batch[1][lo:hi])


@pytest.mark.parametrize("V", [5, 37, 48, 50_257 % 97])
def test_vocabularies_not_a_power_of_two_with_top_k_near_and_past_v(V):
    """top-k at V-1, V and past V beside small ones (the k-th value's ``topk`` width clipped to V)."""
    gen = torch.Generator().manual_seed(V)
    ks = [V - 1, V, V + 3, 1, 2]
    groups, segments, lo = [], [], 0
    for i, k in enumerate(ks):
        groups.append(RowGroup(lo, lo + 3, SamplingParams(seed=i, temperature=0.9, top_k=k),
                               Draws(i, 1, [0, 1, 2])))
        segments.append((lo, lo + 3, 1, None))
        lo += 3
    logits = torch.randn(lo, V, generator=gen)
    _same(_eager(logits, groups, segments), sg.StepGraphs("cpu").sample_and_select(logits.clone(), groups, segments))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_give_the_eager_result(dtype):
    groups, segments, logits = _groups(5)
    logits = logits.to(dtype)
    _same(_eager(logits, groups, segments), sg.StepGraphs("cpu").sample_and_select(logits.clone(), groups, segments))


@pytest.mark.parametrize("bad", ["nan-row", "nan-entry", "inf-entry", "all-forbidden"])
def test_non_finite_rows_change_nothing_else_and_match_the_eager_pass(bad):
    """A row of NaN logits, one NaN or +inf entry, or a row whose every token is forbidden (-inf): the other rows
    are those of the clean batch and the static step gives what the eager pass gives (NaN where it does)."""
    groups, segments, logits = _groups(6)
    clean = sg.StepGraphs("cpu").sample_and_select(logits.clone(), groups, segments)
    row = 4  # inside the sampled top-k / top-p margin request (rows 3-4)
    if bad == "nan-row":
        logits[row] = float("nan")
    elif bad == "nan-entry":
        logits[row, 7] = float("nan")
    elif bad == "inf-entry":
        logits[row, 7] = float("inf")
    else:
        logits[row] = float("-inf")
    want = _eager(logits, groups, segments)
    got = sg.StepGraphs("cpu").sample_and_select(logits.clone(), groups, segments)
    _same(want, got, nan_ok=True)
    lo, hi = 3, 5  # the damaged request's rows; the others' are untouched
    others = torch.cat([torch.arange(0, lo), torch.arange(hi, logits.shape[0])])
    for field in ("tokens", "probability", "score", "logprob"):
        assert torch.equal(getattr(got[0], field)[others], getattr(clean[0], field)[others]), field
    assert torch.equal(got[1][others], clean[1][others])


def test_decoding_with_requests_joining_and_leaving_through_captured_steps(fake_cuda_graphs):
    """Requests added at different steps (joining a batch in flight, leaving as they finish, other block sizes):
    the events with the captured static step equal those without it, and graphs were replayed."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    requests = [dict(temperature=0, block_size=4, max_tokens=4), dict(temperature=0.9, seed=5, block_size=4, top_k=20),
                dict(temperature=0, block_size=4, threshold=0.3, max_tokens=12),
                dict(temperature=0.7, seed=6, block_size=8, remasking="margin", top_p=0.8),
                dict(temperature=0, block_size=4, remasking="left_to_right", min_tokens=3, logit_bias={3: 2.0}),
                dict(temperature=0, block_size=8, sub_block_size=4, cfg_scale=0.5, max_tokens=6),
                dict(temperature=0.5, seed=9, block_size=4, repetition_penalty=1.3, presence_penalty=0.4),
                dict(temperature=0, block_size=4, logprobs=True, top_logprobs=2)]
    joins = [0, 0, 1, 2, 2, 4, 5, 6]  # the engine step at which each request arrives
    prompts = [model.tokenizer(dp.PROMPTS[i % len(dp.PROMPTS)]).input_ids for i in range(len(requests))]

    def decode(graphs=None):
        llm = LLM(model, max_batch_size=8, enable_prefix_caching=False)
        llm.denoiser.step_graphs = graphs
        engine = llm._engine(8)
        events, step = {}, 0
        while step == 0 or engine.has_unfinished() or step <= max(joins):
            for i in [i for i, j in enumerate(joins) if j == step]:
                kw = dict(dict(max_tokens=8, ignore_eos=True, speculative=False), **requests[i])
                engine.add_request(prompts[i], SamplingParams.from_flat(**kw), f"r{i}")
            for ev in engine.step():
                events.setdefault(ev.request_id, []).append(
                    (ev.block, ev.step, [(r.position, r.token_id, r.logprob) for r in ev.revealed], ev.finished))
            step += 1
        return events

    want = decode()
    graphs = sg.StepGraphs("cpu", capture=True, warmup=1)
    assert decode(graphs) == want and len(want) == len(requests)
    assert graphs.stats["graph_steps"] >= graphs.stats["captures"] >= 1
    assert graphs.stats["eager:top_logprobs"] > 0  # a step holding the top_logprobs request ran the eager pass


def test_shapes_of_one_row_bucket_share_one_logits_buffer(fake_cuda_graphs):
    """Steps in one row bucket with other segment counts and widths (a graph each) fill one ``[R, V]`` logits
    buffer: it was allocated per (rows, segments, width), up to 90 copies of the largest buffer there is (8192 x V
    float32: 4.1 GB at LLaDA-8B's vocabulary). Every replay still gives the eager result."""
    graphs = sg.StepGraphs("cpu", capture=True, warmup=1)
    batches = [_uniform_batch(1, 16, 11, seed=0),   # 16 rows, 1 segment of width 16
               _uniform_batch(4, 4, 11, seed=1),    # 16 rows, 4 segments of width 4
               _uniform_batch(2, 8, 11, seed=2),    # 16 rows, 2 segments of width 8
               _uniform_batch(1, 16, 11, seed=3),   # the first shape again: a replay
               _uniform_batch(4, 4, 11, seed=4)]
    for groups, segments, logits in batches:
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert len(graphs._inputs) == 3 and len({s.logits.data_ptr() for s in graphs._inputs.values()}) == 1
    assert graphs.stats["captures"] == 3 and graphs.stats["graph_steps"] == 5


#: every kind of request beside each other: the plain ones through the static step, the others counted as eager
EVERY_KIND = [dict(temperature=0, block_size=4, multi_block=0.5, max_tokens=12),
              dict(temperature=0.8, seed=2, block_size=4, multi_block=0.75, threshold=0.5, top_k=7),
              dict(temperature=0, block_size=4, speculative=True),
              dict(temperature=0, block_size=4, constraint=True, max_tokens=24),
              dict(temperature=0.6, seed=4, block_size=8, sub_block_size=4, cfg_scale=0.7, remasking="random"),
              dict(temperature=0, block_size=4, remasking="left_to_right", threshold=0.2, frequency_penalty=0.3),
              dict(temperature=1.1, seed=8, block_size=4, min_tokens=6, logit_bias={2: -5.0, 9: 4.0})]


def _decode_all(model, reqs, graphs, arrive_every: int = 1, prompt: int = 0) -> dict:
    """Events per request, request i arriving at engine step ``i * arrive_every`` with prompt ``prompt + i``,
    through ``graphs`` (or none)."""
    from unmask.engine import Constraint

    llm = LLM(model, max_batch_size=8, enable_prefix_caching=False)
    llm.denoiser.step_graphs = graphs
    engine = llm._engine(8)
    pending = []
    for i, kw in enumerate(reqs):
        kw = dict(kw)
        if kw.pop("constraint", None):
            kw["constraint"] = Constraint("json_schema", dp.SCHEMA)
        flat = dict({"speculative": False, "max_tokens": 10, "ignore_eos": "constraint" not in kw}, **kw)
        ids = model.tokenizer(dp.PROMPTS[(prompt + i) % len(dp.PROMPTS)]).input_ids
        pending.append((i * arrive_every, ids, SamplingParams.from_flat(**flat), f"r{i}"))
    events, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, ids, params, rid = pending.pop(0)
            engine.add_request(ids, params, rid)
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(
                (ev.block, ev.step, [(r.position, r.token_id, r.logprob) for r in ev.revealed], ev.finished))
        step += 1
    return events


def test_every_kind_of_request_in_one_batch_through_captured_steps(fake_cuda_graphs):
    """Multi-block (quota and threshold), speculative, grammar-constrained, CFG with sub-blocks, every remasking,
    penalties, min_tokens and logit_bias joining one at a time: the events without graphs, with captured steps; and
    each request alone through captured steps: its events without graphs bit for bit, its tokens in the batch (the
    forward's own batch contract decides the log-probabilities' last bits, not the static step)."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    want = _decode_all(model, EVERY_KIND, None)
    graphs = sg.StepGraphs("cpu", capture=True, warmup=1)
    assert _decode_all(model, EVERY_KIND, graphs) == want
    assert graphs.stats["graph_steps"] > 0 and graphs.stats["eager:verify"] > 0
    assert graphs.stats["eager:own consume"] > 0
    for i, kw in enumerate(EVERY_KIND):
        alone = _decode_all(model, [kw], sg.StepGraphs("cpu", capture=True, warmup=0), prompt=i)
        assert alone == _decode_all(model, [kw], None, prompt=i), kw
        tokens = [[(p, t) for p, t, _ in e[2]] for e in alone["r0"]]
        assert tokens == [[(p, t) for p, t, _ in e[2]] for e in want[f"r{i}"]], kw


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("paths"))


def _on_a_fake_gpu(name, checkpoints, monkeypatch, graphs: bool):
    """Three requests of path ``name`` decoded on fake CUDA (through the static step when ``graphs``): asserts the
    CPU's tokens in the same weights, and at most one host read and no other sync per step outside the forward."""
    from device_tags import fake_cuda
    from sync_counter import SyncCounter

    from unmask.engine.denoiser import Denoiser
    from unmask.engine.model import LoadedModel, load_model

    path = next(p for p in dp.PATHS if p.name == name)
    params = SamplingParams.from_flat(**dict(path.params, max_tokens=8, ignore_eos=True))
    prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(3)]
    # the CPU run in the same weights (the CPU's default packs fp16 weights: other logits, other tokens here)
    cpu = load_model(checkpoints[path.checkpoint], dtype="float32", weights="native")
    want = [o.outputs[0].token_ids for o in LLM(cpu, max_batch_size=4, enable_prefix_caching=False).generate(
        prompts, params)]
    with fake_cuda(monkeypatch):
        llm = LLM(load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32"), max_batch_size=4,
                  enable_prefix_caching=False)
        step_graphs = llm.denoiser.step_graphs = sg.StepGraphs(llm.model.device) if graphs else None
        with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                c.step_method(Denoiser, "step"):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    if graphs:
        assert step_graphs.stats["static_steps"] > 0 and not step_graphs.stats["eager_steps"]
        bufs = {b.device.type for s in step_graphs._inputs.values() for b in (s.logits, s.ints, s.floats)}
        assert bufs == {"cuda"}
    for step in c.steps:
        outside = {k: v - step["forward_syncs"].get(k, 0) for k, v in step["syncs"].items()}
        assert {k for k, v in outside.items() if v} <= {"host read"} and outside.get("host read", 0) <= 1, step


@pytest.mark.parametrize("name", ["multi-block", "remasking-left-to-right", "logit-bias-min-tokens", "penalties"])
def test_on_a_faked_gpu_more_paths_keep_the_cpu_tokens_and_one_host_read(name, checkpoints, monkeypatch):
    """Paths test_step_graphs leaves out (multi-block windows, left-to-right remasking, min_tokens and logit_bias,
    penalties) through the static step on fake CUDA: the CPU's tokens, every
    buffer on the device, at most one host read per step outside the forward (penalties made a blocking copy of
    their counts per penalised request per step)."""
    _on_a_fake_gpu(name, checkpoints, monkeypatch, graphs=True)


@pytest.mark.parametrize("name", ["remasking-left-to-right", "penalties"])
def test_on_a_faked_gpu_the_eager_pass_copies_nothing_blocking_either(name, checkpoints, monkeypatch):
    """Without graphs: the left-to-right order (built on the host) and the penalties' counts reached the device by
    a blocking copy each step (one per penalised request): now non-blocking pinned copies."""
    _on_a_fake_gpu(name, checkpoints, monkeypatch, graphs=False)


def test_a_shape_whose_capture_fails_runs_uncaptured_and_the_requests_are_served(fake_cuda_graphs, monkeypatch):
    """A capture that raises (CUDA refuses an op under capture, say) failed the step, and every later step of that
    shape retried and failed again: every request of that batch shape failed. Now the shape runs through the static
    step uncaptured (counted, logged) with the eager pass's results, and other shapes still capture."""
    import contextlib

    real = torch.cuda.graph
    refused = []

    @contextlib.contextmanager
    def failing(g, pool=None, stream=None, capture_error_mode="global"):
        if not refused:
            refused.append(1)
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        with real(g, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield

    monkeypatch.setattr(torch.cuda, "graph", failing)
    graphs = sg.StepGraphs("cpu", capture=True, warmup=0)
    for seed in (0, 1):  # the same shape twice: the first call's capture fails, the second does not retry it
        groups, segments, logits = _groups(seed)
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert graphs.stats["eager:capture failed"] == 2 and not graphs.graphs and len(refused) == 1
    groups, segments, logits = _uniform_batch(2, 8, 48)  # another shape captures as before
    _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert graphs.stats["captures"] == 1


def test_past_the_graph_cap_a_new_shape_runs_uncaptured_and_captured_ones_still_replay(fake_cuda_graphs):
    """Graphs are keyed by bucket and parts, so mixed traffic keeps capturing (14 captures in 24 steps seen): each
    holds pool memory outside the KV budget and synchronizes the device. Past ``max_graphs`` a new shape runs
    through the static step uncaptured, with the eager pass's results; a captured shape still replays."""
    graphs = sg.StepGraphs("cpu", capture=True, warmup=0, max_graphs=2)
    shapes = [_uniform_batch(1, 16, 11, seed=0), _uniform_batch(4, 4, 11, seed=1), _uniform_batch(2, 8, 11, seed=2),
              _uniform_batch(1, 16, 11, seed=3)]
    for groups, segments, logits in shapes:
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert len(graphs.graphs) == 2 and graphs.stats["captures"] == 2
    assert graphs.stats["eager:graph cap"] == 1 and graphs.stats["graph_steps"] == 3
