"""Tensor parallelism's rules without a process group (plain run; the 2-process runs: test_tensor_parallel.py).

The options and what cannot be sharded are refused naming the option; a request rebuilt on another rank from what
rank 0 publishes (prompt ids, choice 0's resolved plan) is the same request, seeds included, so the ranks step
alike (docs/design.md#scale-out)."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from tiny import loaded
from unmask.engine import EngineConfig, SamplingParams
from unmask.engine.engine import Engine, make_requests
from unmask.engine.tensor_parallel import _encode_enqueue, check_shardable, shard_model


def test_options_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="tensor_parallel_timeout"):
        EngineConfig(tensor_parallel_timeout=0).validate()
    assert EngineConfig(tensor_parallel_size=2).load_options()["weights"] == "native"  # auto: packing is not sharded
    assert EngineConfig(tensor_parallel_size=2, weights="fp16").load_options()["weights"] == "fp16"  # refused later


def test_what_cannot_be_sharded_is_refused():
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    check_shardable(cfg, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's 2 key/value heads"):
        check_shardable(cfg, 4)
    m = loaded()
    m.weight_format = "fp16"
    with pytest.raises(ValueError, match="tensor_parallel_size: weights 'fp16' are packed"):
        shard_model(m, 2)
    m = loaded()
    m.row_variant = object()
    with pytest.raises(ValueError, match="mask-row adapter or verifier"):
        shard_model(m, 2)


def test_a_published_request_rebuilds_identically():
    m = loaded(block_size=4)
    engine = Engine(m)
    ids = m.tokenizer.encode("The quick brown fox jumps")
    seqs = engine.make_request(ids, SamplingParams(max_tokens=8, temperature=0.8), "r1", n=3)  # no seed: drawn once
    for s in seqs:
        s.group, s.cache_salt = "g", "tenant"
    ids2, plan, rid, n, group, salt = pickle.loads(pickle.dumps(_encode_enqueue(seqs)))  # crosses the channel
    again = make_requests(m, ids2, plan.params, rid, n, engine.defaults, plan=plan)
    assert [s.plan for s in again] == [s.plan for s in seqs] and len({s.plan.seed for s in again}) == 3
    assert all(torch.equal(a.canvas, b.canvas) for a, b in zip(again, seqs))
    assert (rid, n, group, salt) == ("r1", 3, "g", "tenant")


def test_a_follower_replays_calls_and_stops_when_it_diverges(monkeypatch):
    from unmask.engine import tensor_parallel as tp

    m = loaded(block_size=4)
    leader, follower = Engine(m), Engine(m)
    seqs = leader.make_request(m.tokenizer.encode("One two three"), SamplingParams(max_tokens=4, temperature=0),
                               "r1")
    leader.enqueue(seqs)
    messages = [("enqueue", _encode_enqueue(seqs)),
                ("step", ((), {}, tp._state(leader))),  # what rank 0 publishes before its step
                ("step", ((), {}, ((("r9", 0),), ())))]  # a state rank 1 cannot have
    feed = iter(messages)
    monkeypatch.setattr(tp, "_receive", lambda: next(feed))
    monkeypatch.setattr(tp, "_group", SimpleNamespace(rank=1))
    with pytest.raises(tp.TensorParallelError, match="rank 1 diverged from rank 0 before step"):
        tp.follow(follower)
    leader.step()
    assert tp._state(follower) == tp._state(leader) and follower.has_unfinished()  # the replayed step matched
