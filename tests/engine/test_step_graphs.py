"""The static post-forward step and its CUDA graphs (engine/step_graphs.py, engine/buckets.py; docs/design.md#decoding,
"Static shapes and CUDA graphs"; issue 42).

On a CPU the capture path runs up to the capture call against a fake ``torch.cuda`` graph API (:class:`FakeGraph`):
capturing records every aten op of the captured call with the very tensors it used, and a replay re-runs the
recorded ops on those tensors, writing each result into the tensor the capture produced, as a GPU replays the
recorded kernels on fixed addresses. So a value baked in at capture, an input not copied into the static buffer or
an output read from a fresh tensor shows here as a wrong result; a host read inside the capture raises as CUDA's
capture does. The ``cuda``-marked tests at the end run the real capture on a GPU (they skip without one).
"""
import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decoding_paths as dp  # noqa: E402
import tiny  # noqa: E402

from unmask.engine import LLM, SamplingParams  # noqa: E402
from unmask.engine import step_graphs as sg  # noqa: E402
from unmask.engine.buckets import ROW_BUCKETS, SEGMENT_BUCKETS, WIDTH_BUCKETS, bucket  # noqa: E402
from unmask.engine.noise import Draws  # noqa: E402
from unmask.engine.reveal_rule import select_segments  # noqa: E402
from unmask.engine.sampler import RowGroup, filter_rows, filter_top_k_top_p, prepare_groups, sample_groups  # noqa: E402

aten = torch.ops.aten
V = 48

#: one group per kind of row the static step serves: (params, rows, segment rule (quota, threshold))
KINDS = [
    (dict(temperature=0.0), 3, (2, None)),
    (dict(temperature=0.8, top_k=5, top_p=0.9, remasking="margin"), 2, (None, 0.3)),
    (dict(temperature=0.7, remasking="random"), 2, (3, None)),
    (dict(temperature=0.0, remasking="entropy", top_p=0.6), 1, (1, None)),
    (dict(temperature=0.0, remasking="left_to_right"), 1, (None, 0.5)),
    (dict(temperature=1.3, top_k=V + 4), 2, (1, None)),  # top-k past V: no filter
    (dict(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.3, min_tokens=3), 2, (5, None)),
]


def _groups(seed: int = 0, kinds=KINDS):
    """Row groups of every kind in :data:`KINDS` (13 rows), their segments, and ``[13, V]`` logits."""
    gen = torch.Generator().manual_seed(seed)
    groups, segments, lo = [], [], 0
    for i, (kw, n, (quota, threshold)) in enumerate(kinds):
        params = SamplingParams(seed=seed * 10 + i, **kw)
        extra = {}
        if kw.get("min_tokens"):
            extra = dict(min_tokens_rows=torch.tensor([True, False]), min_tokens_ids=torch.tensor([1, 2]),
                         context_ids=torch.tensor([3, 3, 7]), bias=(torch.tensor([4, 9]), torch.tensor([2.0, -1.0])))
        groups.append(RowGroup(lo, lo + n, params, Draws(seed * 10 + i, seed + 2, list(range(20 + lo, 20 + lo + n))),
                               left_to_right_base=i, **extra))
        segments.append((lo, lo + n, quota, threshold))
        lo += n
    logits = torch.randn(lo, V, generator=gen) * 3
    return groups, segments, logits


def _eager(logits, groups, segments, forbidden=None):
    cands = sample_groups(logits.clone(), groups, forbidden)
    return cands, select_segments(cands, segments)


def _same(a, b) -> None:
    (ca, cha), (cb, chb) = a, b
    for field in ("tokens", "probability", "score", "logprob"):
        x, y = getattr(ca, field), getattr(cb, field)
        assert x.dtype == y.dtype and torch.equal(x, y), (field, x, y)
    assert torch.equal(cha, chb), (cha, chb)


def test_a_size_takes_the_smallest_rung_and_none_past_the_top():
    for ladder in (ROW_BUCKETS, SEGMENT_BUCKETS, WIDTH_BUCKETS):
        assert list(ladder) == sorted(set(ladder))
        assert bucket(0, ladder) == ladder[0] and bucket(ladder[-1], ladder) == ladder[-1]
        assert bucket(ladder[-1] + 1, ladder) is None
    assert bucket(13, ROW_BUCKETS) == 16 and bucket(33, ROW_BUCKETS) == 48 and bucket(129, ROW_BUCKETS) == 192
    assert bucket(3, SEGMENT_BUCKETS) == 4 and bucket(5, WIDTH_BUCKETS) == 8


@pytest.mark.parametrize("k_width", [None, 8, 5])
def test_per_row_filters_equal_the_scalar_filter_row_by_row(k_width):
    """Each row's top-k / top-p as the scalar filter does it, the k-th value from a full sort or one narrower
    ``topk`` (at least the largest active k)."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 2
    logits[3, :10] = logits[3, 10]  # ties at the boundary
    settings = [(0, 1.0), (5, 1.0), (0, 0.7), (3, 0.5), (V, 0.95), (1, 0.2)]
    k = torch.tensor([s[0] for s in settings])
    p = torch.tensor([s[1] for s in settings], dtype=torch.float32)
    got = filter_rows(logits.clone(), k, p, k_width)
    for i, (kk, pp) in enumerate(settings):
        want = filter_top_k_top_p(logits[i:i + 1].clone(), kk, pp)
        assert torch.equal(got[i:i + 1], want), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_bucketed_step_gives_the_eager_passs_tokens_and_probabilities_bit_for_bit(dtype, seed):
    """13 rows of every kind (padded to 16 rows, 7 segments to 8, width 4), float32 and bf16 logits: the static
    step's tokens, probabilities, log-probabilities, scores and reveals are the eager ``sample_groups`` +
    ``select_segments``'s (unbucketed), and the static buffers hold the prepared rows and zero padding."""
    groups, segments, logits = _groups(seed)
    logits = logits.to(dtype)
    forbidden = torch.tensor([0, V - 1])
    want = _eager(logits, groups, segments, forbidden)
    graphs = sg.StepGraphs("cpu")
    got = graphs.sample_and_select(logits.clone(), groups, segments, forbidden)
    _same(want, got)
    assert graphs.stats["static_steps"] == 1 and not graphs.stats["eager_steps"]
    (shape, static), = [(k, v) for k, v in graphs._inputs.items()]
    assert shape == (16, 8, 4, V)
    assert torch.equal(static.logits[:13], prepare_groups(logits.clone(), groups, forbidden))
    assert not static.logits[13:].any()


def test_a_padding_row_changes_no_real_row():
    """The same rows in a 16-row bucket whose padding holds other values give the same results (row by row)."""
    groups, segments, logits = _groups(2)
    shape, ints, floats = sg.step_tables(groups, segments, 13, V)
    padded = torch.zeros(shape.rows, V)
    padded[:13] = prepare_groups(logits.clone(), groups)
    other = padded.clone()
    other[13:] = torch.randn(3, V) * 100
    a = sg.post_forward_step(padded, ints, floats, **shape.flags())
    b = sg.post_forward_step(other, ints, floats, **shape.flags())
    for x, y in zip(a, b):
        assert torch.equal(x[:13], y[:13])


def test_a_step_it_cannot_serve_runs_the_eager_pass_and_is_counted():
    groups, segments, logits = _groups(0)
    groups[0].params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    graphs = sg.StepGraphs("cpu")
    cands, chosen = graphs.sample_and_select(logits.clone(), groups, segments)
    assert cands.top_ids is not None and graphs.stats["eager:top_logprobs"] == 1 and graphs.stats["eager_steps"] == 1
    _same(_eager(logits, groups, segments), (cands, chosen))
    wide = [(0, 13, 2, None)] + segments[1:]
    assert sg.step_tables(groups[1:], wide, 13, V) != "width"
    assert sg.step_tables(groups[1:], segments, ROW_BUCKETS[-1] + 1, V) == "rows"


def test_the_post_forward_step_compiles_as_one_graph():
    """``torch.compile(fullgraph=True)`` (dynamo's tracing with the eager backend: a graph break is an error) of the
    static step gives its results."""
    torch._dynamo.reset()
    groups, segments, logits = _groups(0)
    shape, ints, floats = sg.step_tables(groups, segments, 13, V)
    padded = torch.zeros(shape.rows, V)
    padded[:13] = prepare_groups(logits.clone(), groups)
    want = sg.post_forward_step(padded, ints, floats, **shape.flags())
    got = torch.compile(sg.post_forward_step, fullgraph=True, backend="eager")(padded, ints, floats, **shape.flags())
    for x, y in zip(want, got):
        assert torch.equal(x, y)


@pytest.mark.system
def test_the_post_forward_step_compiles_with_inductor():
    """The same with inductor (generated kernels; about a minute on 2 cores): tokens and reveals equal, scores
    within float64 rounding (inductor fuses the reductions in another order)."""
    torch._dynamo.reset()
    groups, segments, logits = _groups(0, KINDS[:3])
    n = logits.shape[0]
    shape, ints, floats = sg.step_tables(groups, segments, n, V)
    padded = torch.zeros(shape.rows, V)
    padded[:n] = prepare_groups(logits.clone(), groups)
    want = sg.post_forward_step(padded, ints, floats, **shape.flags())
    got = torch.compile(sg.post_forward_step, fullgraph=True)(padded, ints, floats, **shape.flags())
    assert torch.equal(want[0], got[0]) and torch.equal(want[4], got[4])
    for x, y in zip(want[1:4], got[1:4]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ the capture path against a fake graph API
SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.is_nonzero.default}


class _Recorder(TorchDispatchMode):
    """Records every aten op with its arguments and results; a host read raises (CUDA's capture refuses it)."""

    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            raise RuntimeError(f"{func}: a host read inside a CUDA graph capture")
        out = func(*args, **kwargs)
        self.tape.append((func, args, kwargs, out))
        return out


class FakeGraph:
    """``torch.cuda.CUDAGraph`` on a CPU: :meth:`replay` re-runs the captured ops on the captured tensors."""

    def __init__(self):
        self.tape: list = []
        self.replays = 0

    def replay(self):
        for func, args, kwargs, out in self.tape:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(old, torch.Tensor) and new.data_ptr() != old.data_ptr():
                    old.copy_(new)  # the kernel's output address is fixed
        self.replays += 1


class FakeStream:
    def __init__(self, name="side"):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """The ``torch.cuda`` graph and stream API faked on a CPU; yields the log: ``("call", stream)`` per call of
    the step function (``"capture"`` inside ``torch.cuda.graph``), ``("graph", pool)`` per capture."""
    events, where = [], ["default"]
    default = FakeStream("default")

    @contextlib.contextmanager
    def stream(s):
        where[0] = s.name
        yield
        where[0] = "default"

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"  # the server's other threads may use CUDA meanwhile
        events.append(("graph", pool))
        where[0] = "capture"
        with _Recorder(g.tape):
            yield
        where[0] = "default"

    step = sg.post_forward_step

    def counted(*args, **kwargs):
        events.append(("call", where[0]))
        return step(*args, **kwargs)

    monkeypatch.setattr(sg, "post_forward_step", counted)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: default)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", 0))
    yield events


def test_a_bucket_is_captured_once_after_a_side_stream_warm_up_and_replayed_after(fake_cuda_graphs):
    events = fake_cuda_graphs
    graphs = sg.StepGraphs("cpu", capture=True, warmup=2)
    groups, segments, logits = _groups(0)
    with torch.inference_mode():
        _same(_eager(logits, groups, segments), graphs.sample_and_select(logits.clone(), groups, segments))
    assert events == [("call", "side"), ("call", "side"), ("graph", ("pool", 0)), ("call", "capture")]
    (shape, captured), = graphs.graphs.items()
    assert (shape.rows, shape.segments, shape.width) == (16, 8, 4) and captured.graph.replays == 1
    # other values, same bucket and parts: replayed, not called, and equal to the eager pass on the new values
    groups2, segments2, logits2 = _groups(1)
    with torch.inference_mode():
        _same(_eager(logits2, groups2, segments2), graphs.sample_and_select(logits2.clone(), groups2, segments2))
    assert len(events) == 4 and captured.graph.replays == 2 and graphs.stats["captures"] == 1
    # a bigger step: another bucket, its own capture in the same pool
    big = [(kw, n * 3, rule) for kw, n, rule in KINDS]
    groups3, segments3, logits3 = _groups(3, big)
    _same(_eager(logits3, groups3, segments3), graphs.sample_and_select(logits3.clone(), groups3, segments3))
    assert len(graphs.graphs) == 2 and events[-2:] == [("graph", ("pool", 0)), ("call", "capture")]
    assert {s.rows for s in graphs.graphs} == {16, 48}
    assert graphs.stats["graph_steps"] == 3 and not graphs.stats["eager_steps"]


def test_the_step_makes_no_host_read_inside_a_capture(fake_cuda_graphs):
    """Every part on at once (draws, filters, each strategy, thresholds) captured: no host read (the recorder
    raises on one), and a host read would be caught."""
    graphs = sg.StepGraphs("cpu", capture=True, warmup=0)
    groups, segments, logits = _groups(4)
    graphs.sample_and_select(logits.clone(), groups, segments)
    (shape,) = graphs.graphs
    assert shape.sampled and shape.top_p and shape.threshold and shape.strategies == (1, 2, 3, 4)
    assert shape.top_k == 8  # the widest k asked (5), rounded up to a power of two
    with pytest.raises(RuntimeError, match="host read inside a CUDA graph capture"):
        with _Recorder([]):
            torch.ones(2).nonzero()


def test_decoding_through_captured_steps_gives_the_eager_events(fake_cuda_graphs):
    """A mixed batch decoded with the denoiser's step graphs (fake capture) gives every request the events it gets
    without them; the constrained-free steps replay graphs, the speculative one is counted as eager."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    requests = [dict(temperature=0, block_size=4), dict(temperature=0, block_size=4, threshold=0.3),
                dict(temperature=0.9, seed=5, block_size=4, top_k=20, top_p=0.9),
                dict(temperature=0.7, seed=6, block_size=4, remasking="random", steps=6),
                dict(temperature=0, block_size=4, remasking="entropy", logit_bias={5: 5.0}, min_tokens=4),
                dict(temperature=0, block_size=8, sub_block_size=4, cfg_scale=0.5),
                dict(temperature=0, block_size=4, speculative=True)]
    prompts = [model.tokenizer(dp.PROMPTS[i % len(dp.PROMPTS)]).input_ids for i in range(len(requests))]

    def decode(graphs=None):
        llm = LLM(model, max_batch_size=8)  # its own prefix cache: the second run forwards the same rows
        llm.denoiser.step_graphs = graphs
        engine = llm._engine(8)
        for i, (ids, kw) in enumerate(zip(prompts, requests)):
            params = SamplingParams.from_flat(**dict({"speculative": False}, **kw, max_tokens=10, ignore_eos=True))
            engine.add_request(ids, params, f"r{i}")
        events = {}
        while engine.has_unfinished():
            for ev in engine.step():
                events.setdefault(ev.request_id, []).append(
                    (ev.block, ev.step, [(r.position, r.token_id, r.logprob) for r in ev.revealed], ev.finished))
        return events

    want = decode()
    graphs = sg.StepGraphs("cpu", capture=True, warmup=1)
    assert decode(graphs) == want
    assert graphs.stats["captures"] >= 1 and graphs.stats["graph_steps"] > graphs.stats["captures"]
    assert graphs.stats["eager:verify"] > 0 and not graphs.stats["eager_steps"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("paths"))


@pytest.mark.parametrize("name", ["threshold", "sampled-top-k-top-p", "cfg"])
def test_on_a_faked_gpu_the_static_step_keeps_one_host_read_and_one_device(name, checkpoints, monkeypatch):
    """Under fake CUDA (tests/device_tags.py) a batch of 8 decoded through the static step (the path a capture
    records, uncaptured): the path's CPU tokens, every buffer and operation on the model's device (fake CUDA raises
    on a mix), and at most one host read per step outside the forward (the step's summary), no other sync."""
    from device_tags import fake_cuda
    from sync_counter import SyncCounter

    from unmask.engine.denoiser import Denoiser
    from unmask.engine.model import LoadedModel, load_model

    path = next(p for p in dp.PATHS if p.name == name)
    params = SamplingParams.from_flat(**dict(path.params, max_tokens=8, ignore_eos=True))
    prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(8)]
    cpu = load_model(checkpoints[path.checkpoint], dtype="float32", weights="native")  # the fake GPU's weights
    want = [o.outputs[0].token_ids for o in LLM(cpu, max_batch_size=8, enable_prefix_caching=False).generate(
        prompts, params)]
    with fake_cuda(monkeypatch):
        llm = LLM(load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32"), max_batch_size=8,
                  enable_prefix_caching=False)
        graphs = llm.denoiser.step_graphs = sg.StepGraphs(llm.model.device)
        with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                c.step_method(Denoiser, "step"):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want and graphs.stats["static_steps"] > 0 and not graphs.stats["eager_steps"]
    for step in c.steps:
        assert set(step["syncs"]) <= {"host read"} and step["syncs"].get("host read", 0) <= 1, step


def test_cuda_graphs_on_a_cpu_model_is_refused_naming_the_option(checkpoints, monkeypatch, capsys):
    """``LLM(..., cuda_graphs=True)`` on a CPU model is a ValueError naming the option; ``unmask serve`` refuses it
    before the first forward, one line naming the flag or the variable it came from (exit 2)."""
    from unmask.cli.main import main

    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs need a CUDA device, the model is on cpu"):
        LLM(tiny.loaded(attention="prefix_causal", block_size=4), cuda_graphs=True)
    assert main(["serve", str(checkpoints["causal"]), "--port", "0", "--device", "cpu", "--cuda-graphs"]) == 2
    assert "--cuda-graphs: CUDA graphs need a CUDA device, the model is on cpu" in capsys.readouterr().err
    monkeypatch.setenv("UNMASK_CUDA_GRAPHS", "1")
    assert main(["serve", str(checkpoints["causal"]), "--port", "0", "--device", "cpu"]) == 2
    assert "$UNMASK_CUDA_GRAPHS: CUDA graphs need a CUDA device" in capsys.readouterr().err
    # refused before the model is converted or loaded (a minute on a first start; the new-user pass waited 24 s)
    import unmask.engine as engine_api

    def no_load(*a, **k):
        raise AssertionError("loaded a model whose device cuda_graphs refuses")

    monkeypatch.setattr(engine_api, "load_model", no_load)
    monkeypatch.setattr("unmask.cli.serve.resolve_model", no_load)
    assert main(["serve", "--port", "0"]) == 2  # --device auto on this CPU machine, the default model
    assert "$UNMASK_CUDA_GRAPHS: CUDA graphs need a CUDA device, the model is on cpu" in capsys.readouterr().err


# ------------------------------------------------------------------ on a GPU (the cuda lane; skips without one)
@pytest.mark.cuda
def test_on_cuda_a_replayed_step_equals_the_eager_pass():
    """Captured once, replayed on other values: the eager pass's tokens and reveals; probabilities and scores
    within 1e-9 (a GPU's row reductions may split a row by the row count: float64 sums move in the last bits)."""
    import serving

    serving.require_cuda()
    graphs = sg.StepGraphs("cuda", capture=True)
    forbidden = torch.tensor([0], device="cuda")
    for seed in range(3):  # the first call captures, the others replay
        groups, segments, logits = _groups(seed)
        logits = logits.cuda()
        (a, cha), (b, chb) = (_eager(logits, groups, segments, forbidden),
                              graphs.sample_and_select(logits.clone(), groups, segments, forbidden))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(cha, chb)
        for field in ("probability", "score"):
            torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=0, atol=1e-9)
        torch.testing.assert_close(a.logprob, b.logprob, rtol=1e-6, atol=1e-6)
    assert graphs.stats["captures"] == 1 and graphs.stats["graph_steps"] == 3


@pytest.mark.cuda
def test_on_cuda_decoding_with_cuda_graphs_gives_the_same_tokens():
    """The cuda lane's causal checkpoint (loaded through ``load_model`` on the GPU, float32): a sampled batch of 6
    gives the same tokens with ``cuda_graphs`` as without (same forwards; the graphs replay the same step)."""
    import cuda_lane
    import serving

    serving.require_cuda()
    lane = cuda_lane.Lane()
    try:
        prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(6)]
        params = SamplingParams(temperature=0.8, seed=3, block_size=4, max_tokens=12, ignore_eos=True,
                                speculative=False)
        runs = {}
        for graphs in (False, True):
            llm = lane.llm("causal", "cuda", torch.float32, max_batch_size=6, enable_prefix_caching=False,
                           cuda_graphs=graphs)
            runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert runs[True] == runs[False]
        assert llm.denoiser.step_graphs.stats["graph_steps"] > llm.denoiser.step_graphs.stats["captures"] > 0
    finally:
        lane.close()
