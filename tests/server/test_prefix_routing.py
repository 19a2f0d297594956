"""The prefix-aware router's choice without Ray (docs/design.md#scale-out): the chunk keys a prompt is routed by,
and :class:`PrefixAffinity`'s rule (longest held prefix within the load bound, new prompts spread). The Ray cluster
itself: tests/e2e/test_ray_serve.py (system)."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from unmask.engine import ParamError, route_keys
from unmask.engine.prefix_cache import CHUNK_TOKENS
from unmask.server.prefix_routing import PrefixAffinity
from unmask.server.ray_config import RayServeConfig


def test_route_keys_follow_the_prefix_caches_chunks_and_salt():
    a = list(range(100))
    b = a[:40] + [999] * 60  # shares chunks 0 and 1 (tokens 0..31), differs inside chunk 2
    ka, kb = route_keys(a), route_keys(b)
    assert len(ka) == 100 // CHUNK_TOKENS and len(kb) == len(ka)
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))  # a chain: once apart, always apart
    assert route_keys(a[:15]) == []  # no complete chunk
    assert route_keys(a, "alice") != ka and route_keys(a, "alice")[0] != route_keys(a, "bob")[0]
    assert route_keys(a, "alice") == route_keys(list(a), "alice")  # deterministic across calls (and processes)


def test_longest_held_prefix_wins_within_the_load_bound():
    t = PrefixAffinity(imbalance=2, load_weight=0)
    chat = route_keys(list(range(64)))  # 4 chunks
    t.record(chat[:2], "r1")  # turn 1 went to r1
    t.record(route_keys([7] * 64), "r2")
    assert t.match(chat, ["r1", "r2"]) == {"r1": 2, "r2": 0}
    assert t.choose(chat, {"r1": 2, "r2": 0}) == "r1"  # 2 more in flight: within the bound
    assert t.choose(chat, {"r1": 3, "r2": 0}) == "r2"  # beyond it: the load decides


def test_held_chunks_are_weighed_against_requests_in_flight():
    t = PrefixAffinity(imbalance=8, load_weight=2)
    system = list(range(96))  # a 6-chunk system prompt every chat shares
    t.record(route_keys(system + [500] * 16), "r1")  # the first chat went to r1
    new_chat = route_keys(system + [600] * 16)
    assert t.choose(new_chat, {"r1": 2, "r2": 0}) == "r1"  # 6 held chunks > 2 x 2 requests
    assert t.choose(new_chat, {"r1": 3, "r2": 0}) == "r2"  # 6 = 2 x 3: a tie goes to the less loaded
    turn2 = route_keys(system + [500] * 16 + [501] * 48)  # the first chat's next turn: 7 of its 10 chunks held
    assert t.choose(turn2, {"r1": 3, "r2": 0}) == "r1" and t.choose(turn2, {"r1": 4, "r2": 0}) == "r2"


def test_with_batch_slots_only_waiting_counts():
    t = PrefixAffinity(imbalance=8, load_weight=8, slots=4)
    system = list(range(96))  # 6 shared chunks
    t.record(route_keys(system + [500] * 16), "r1")
    new_chat = route_keys(system + [600] * 16)
    assert t.waits(3) == 0 and t.waits(4) == 1 and t.waits(6) == 3
    assert t.choose(new_chat, {"r1": 3, "r2": 0}) == "r1"  # r1's batch has room: its held system prompt wins
    assert t.choose(new_chat, {"r1": 4, "r2": 0}) == "r2"  # r1 would make it wait (8 > 6 chunks): r2
    turn = route_keys(system + [500] * 16 + [501] * 160)  # a long chat: 16 of its chunks held on r1
    t.record(turn[:16], "r1")
    assert t.choose(turn, {"r1": 4, "r2": 0}) == "r1"  # waiting behind 1 (8 chunks) beats prefilling 16
    assert t.choose(turn, {"r1": 5, "r2": 0}) == "r2"  # behind 2 (16 chunks): a tie goes to the less loaded
    with pytest.raises(ValueError, match="slots"):
        PrefixAffinity(slots=-1)


def test_unknown_prompts_spread_and_ties_go_to_the_least_loaded():
    t = PrefixAffinity(imbalance=4)
    placed = []
    for i in range(8):
        keys = route_keys([100 + i] * 32)
        r = t.choose(keys, {"r1": 0, "r2": 0})
        t.record(keys, r)
        placed.append(r)
    assert placed == ["r1", "r2"] * 4  # new chats take the idle replicas in turn
    short = []
    for _ in range(4):  # prompts shorter than a chunk have no key: in turn too
        short.append(t.choose([], {"r1": 0, "r2": 0}))
        t.record([], short[-1])
    assert short == ["r1", "r2"] * 2
    assert t.choose(route_keys([5] * 32), {"r1": 1, "r2": 0}) == "r2"


def test_forgotten_replicas_and_the_key_bound():
    t = PrefixAffinity(max_keys=3)
    keys = route_keys(list(range(80)))  # 5 chunks
    t.record(keys, "r1")
    assert t.held("r1") == 3 and t.match(keys, ["r1"]) == {"r1": 0}  # the oldest (leading) keys were dropped
    t.record(keys[:2], "r1")
    assert t.match(keys, ["r1"]) == {"r1": 2}
    t.forget("r1")
    assert t.held("r1") == 0 and t.match(keys, ["r1"]) == {"r1": 0}
    with pytest.raises(ValueError, match="load"):
        t.choose(keys, {})
    with pytest.raises(ValueError, match="imbalance"):
        PrefixAffinity(imbalance=-1)
    with pytest.raises(ValueError, match="load_weight"):
        PrefixAffinity(load_weight=float("nan"))


def test_param_error_crosses_processes():
    err = pickle.loads(pickle.dumps(ParamError("max_tokens", "too long")))
    assert isinstance(err, ParamError) and (err.field, err.reason, str(err)) == (
        "max_tokens", "too long", "max_tokens: too long")


def test_ray_config_names_the_bad_field():
    RayServeConfig(ray_min_replicas=1, ray_max_replicas=3).validate()
    for kw, field in (({"ray_min_replicas": 0}, "ray_min_replicas"),
                      ({"ray_min_replicas": 2, "ray_max_replicas": 1}, "ray_max_replicas"),
                      ({"ray_upscale_delay": -1.0}, "ray_upscale_delay"), ({"ray_router": "x"}, "ray_router"),
                      ({"ray_imbalance": -1}, "ray_imbalance"), ({"ray_load_weight": -1.0}, "ray_load_weight")):
        with pytest.raises(ValueError, match=field):
            RayServeConfig(**kw).validate()


def test_plain_serve_does_not_import_ray():
    """The embedded default stays Ray-free: serve's parser (the --ray flags included) and the app import no Ray."""
    code = ("import sys; from unmask.cli.main import build_parser; import unmask.server.app; "
            "build_parser().parse_args(['serve', '--ray-min-replicas', '2']); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
