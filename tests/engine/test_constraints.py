"""Constrained decoding (docs/design.md#constrained-decoding) and logit_bias on tiny random models: a random model's
output under a grammar must still parse and validate, on the plain and the speculative path, and unconstrained requests
in the same batch must not change."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from step_together import step_together
from tiny import loaded
from unmask.engine import LLM, Constraint, ParamError, SamplingParams
from unmask.engine.constraints import check_constraint, compile_constraint
from unmask.engine.scheduler import Scheduler

# bounded so that it closes well within max_tokens: short strings, small integers, enums, few items
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 4},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}}}
TOOLS = {"get_weather": {"type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"city": {"enum": ["Paris", "Tokyo"]}}},
         "add": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                 "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def tool_call_lark(tools: dict) -> str:
    """A Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` grammar, one %json per tool."""
    rules = []
    for name, params in tools.items():
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": name}, "arguments": params},
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        rules.append(f"%json {json.dumps(schema)}")
    return 'start: "<tool_call>" call "</tool_call>"\ncall: ' + "\n    | ".join(rules) + "\n"


@pytest.fixture(scope="module")
def llms():
    return {"causal": LLM(loaded(attention="prefix_causal", block_size=4), default_drafts="on"),
            "bidirectional": LLM(loaded(attention="bidirectional", block_size=8))}


def _out(llm, params, prompt="Hello"):
    return llm.generate(prompt, params)[0].outputs[0]


# ---------------------------------------------------------------- outputs follow the grammar
def test_json_schema_output_of_50_seeded_generations_validates(llms):
    """50 seeds of a random model, quota and threshold decoding: every output parses and validates."""
    c = Constraint("json_schema", SCHEMA)
    for seed in range(50):
        p = SamplingParams(max_tokens=96, temperature=1.0, seed=seed, constraint=c, speculative=False,
                           threshold=0.6 if seed % 2 else None)
        out = _out(llms["causal"], p)
        assert out.finish_reason == "stop", (seed, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_parses_on_a_bidirectional_model(llms):
    for seed in range(6):
        out = _out(llms["bidirectional"], SamplingParams(max_tokens=48, temperature=1.0, seed=seed, top_k=20,
                                                         constraint=Constraint("json_object")))
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # max_tokens first: the text is a prefix of a JSON object (finish_reason length, as OpenAI)
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_lark_tool_call_grammar_always_yields_a_parseable_call(llms):
    c = Constraint("lark", tool_call_lark(TOOLS), field="tool_choice")
    for seed in range(12):
        for llm in llms.values():
            out = _out(llm, SamplingParams(max_tokens=96, temperature=1.0, seed=seed, constraint=c))
            m = re.fullmatch(r"<tool_call>(.*)</tool_call>", out.text, re.S)
            assert m and out.finish_reason == "stop", out.text
            call = json.loads(m.group(1))
            jsonschema.validate(call["arguments"], TOOLS[call["name"]])


def test_regex_constraint_matches_whole_output(llms):
    c = Constraint("regex", r"(yes|no), [0-9]{2}")
    for seed in range(5):
        out = _out(llms["causal"], SamplingParams(max_tokens=16, temperature=1.0, seed=seed, constraint=c,
                                                  speculative=False))
        assert re.fullmatch(r"(yes|no), [0-9]{2}", out.text), out.text


def test_forced_tokens_do_not_count_against_the_quota(llms):
    """One token per step unconstrained; under a schema the grammar-forced tokens (keys, braces, EOS) come free,
    so TPF > 1 at the same step budget."""
    c = Constraint("json_schema", SCHEMA)
    out = _out(llms["causal"], SamplingParams(max_tokens=96, temperature=0, constraint=c, speculative=False))
    assert out.finish_reason == "stop"
    assert len(out.token_ids) / out.nfe > 1.5


# ---------------------------------------------------------------- speculative path
def test_speculative_greedy_constrained_equals_constrained_block_1(llms):
    """On the speculative path a draft is accepted only where the grammar allows it and the verifier's token is
    masked: greedy output = constrained block_size=1 greedy decoding, token for token."""
    llm = llms["causal"]
    c = Constraint("json_schema", SCHEMA)
    for prompt in ("Hello", "The quick brown fox"):
        spec = _out(llm, SamplingParams(max_tokens=96, temperature=0, constraint=c, speculative=True,
                                        block_size=4), prompt)
        ar = _out(llm, SamplingParams(max_tokens=96, temperature=0, constraint=c, speculative=False, block_size=1),
                  prompt)
        assert spec.speculative and spec.token_ids == ar.token_ids
        jsonschema.validate(json.loads(spec.text), SCHEMA)
        # the tokens the grammar forces are final without a forward of their own, even at block 1
        assert spec.nfe <= ar.nfe and len(ar.token_ids) / ar.nfe > 1.5


def assert_speculative_constrained_greedy_is_constrained_block_1(llm, ref, **kw):
    """Greedy speculative decoding of ``llm`` under :data:`SCHEMA` (``kw``: more SamplingParams) gives ``ref``'s
    constrained ``block_size=1`` greedy tokens, and the output validates. ``ref``: the model whose causal rows
    verify (``llm`` itself, or its separate verifier / parent)."""
    c = Constraint("json_schema", SCHEMA)
    for prompt in ("Hello", "The quick brown fox"):
        spec = _out(llm, SamplingParams(max_tokens=96, temperature=0, constraint=c, speculative=True, block_size=4,
                                        **kw), prompt)
        b1 = _out(ref, SamplingParams(max_tokens=96, temperature=0, constraint=c, speculative=False, block_size=1),
                  prompt)
        assert spec.speculative and spec.token_ids == b1.token_ids, (prompt, spec.text, b1.text)
        assert spec.finish_reason == "stop", spec.text
        jsonschema.validate(json.loads(spec.text), SCHEMA)


def test_speculative_sampling_constrained_validates(llms):
    c = Constraint("json_schema", SCHEMA)
    for seed in range(8):
        out = _out(llms["causal"], SamplingParams(max_tokens=96, temperature=1.0, seed=seed, constraint=c,
                                                  speculative=True, block_size=4))
        assert out.speculative and out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


# ---------------------------------------------------------------- unconstrained rows never change
@pytest.mark.parametrize("speculative", [False, True])
def test_unconstrained_requests_unchanged_next_to_constrained_ones(llms, speculative):
    llm = llms["causal"]
    plain = [SamplingParams(max_tokens=12, temperature=0.8, seed=3, speculative=speculative, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=0, speculative=speculative, ignore_eos=True)]
    constrained = SamplingParams(max_tokens=64, temperature=1.0, seed=1, speculative=speculative,
                                 constraint=Constraint("json_schema", SCHEMA))
    prompts = ["Hello world", "Paris", "One two"]
    alone = [_out(llm, sp, p).token_ids for p, sp in zip(prompts, plain)]
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, plain + [constrained])):
        seqs += llm.make_sequences(llm.encode(p), sp, f"r{i}")
    step_together(llm.denoiser, seqs)
    assert [s.output_ids for s in seqs[:2]] == alone
    jsonschema.validate(json.loads(seqs[2].text), SCHEMA)


# ---------------------------------------------------------------- logit_bias
@pytest.mark.parametrize("speculative", [False, True])
def test_logit_bias_minus_100_bans_and_plus_100_forces(llms, speculative):
    llm = llms["causal"]
    base = dict(max_tokens=16, temperature=0, ignore_eos=True, speculative=speculative)
    ids = _out(llm, SamplingParams(**base)).token_ids
    banned = max(set(ids), key=ids.count)
    assert banned not in _out(llm, SamplingParams(**base, logit_bias={banned: -100})).token_ids
    sampled = _out(llm, SamplingParams(**{**base, "temperature": 1.0}, seed=0, logit_bias={banned: -100}))
    assert banned not in sampled.token_ids
    forced = 37
    assert set(_out(llm, SamplingParams(**base, logit_bias={forced: 100})).token_ids) == {forced}


def test_logit_bias_errors_name_the_field(llms):
    for bad in ({5: 101.0}, {5: float("nan")}, {"5": 1.0}, {-1: 1.0}, [1, 2]):
        with pytest.raises(ParamError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.field == "logit_bias"
    llm = llms["causal"]
    with pytest.raises(ParamError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=4, logit_bias={10 ** 6: 1.0}))
    assert e.value.field == "logit_bias" and "vocabulary" in str(e.value)


# ---------------------------------------------------------------- errors and compilation
@pytest.mark.parametrize("kind,spec", [("lark", "start: foo("), ("regex", "[a-z"), ("json_schema", {"type": "nope"}),
                                       ("json_schema", "{not json"), ("json_schema", [1]), ("lark", ""),
                                       ("json_schema", "[" * 3000 + "]" * 3000),  # was a RecursionError
                                       ("yaml", "a: b")])
def test_invalid_grammar_is_a_param_error_naming_the_field(llms, kind, spec):
    with pytest.raises(ParamError) as e:
        c = Constraint(kind, spec, field="tool_choice")
        llms["causal"].generate("Hi", SamplingParams(max_tokens=4, constraint=c))
    assert e.value.field == "tool_choice"
    if kind in ("lark", "regex") and spec:
        with pytest.raises(ParamError):
            check_constraint(Constraint(kind, spec))


def test_grammar_is_compiled_once_per_spec_and_choices_get_their_own_state(llms):
    from unmask.engine.constraints import _compiled

    llm = llms["causal"]
    tok, V = llm.model.tokenizer, llm.model.vocab_size
    a = compile_constraint(Constraint("json_schema", {"type": "object", "properties": {"k": {"enum": [1, 2]}}}),
                           tok, V, [0])
    misses = _compiled.cache_info().misses
    b = compile_constraint(Constraint("json_schema", '{"properties": {"k": {"enum": [1, 2]}}, "type": "object"}'),
                           tok, V, [0])
    assert _compiled.cache_info().misses == misses  # the same canonical spec: no new compilation
    assert a.matcher is not b.matcher
    first = int(a.allowed().nonzero()[0])
    assert a.push(first) and a.pushed == 1 and b.pushed == 0
    a.pop()
    assert a.pushed == 0 and bool((a.allowed() == b.allowed()).all())


def test_grammar_with_infilling_is_refused(llms):
    with pytest.raises(ParamError) as e:
        llms["bidirectional"].generate("Hi", SamplingParams(max_tokens=8, constraint=Constraint("json_object"),
                                                            suffix=" end"))
    assert e.value.field == "response_format"


def test_constraints_equal_by_canonical_spec():
    assert Constraint("json_schema", {"a": 1, "b": 2}) == Constraint("json_schema", '{"b": 2, "a": 1}')
    assert hash(Constraint("json_object")) == hash(Constraint("json_object", None))
    assert Constraint("regex", "a") != Constraint("regex", "b")


def test_speculative_sampling_under_a_grammar_follows_constrained_block_1_sampling():
    """Speculative sampling against the masked target (masked drafts with their masked q, masked verifier rows)
    gives the outputs the distribution of constrained block_size=1 sampling: two empirical distributions over the
    9 strings of the grammar (random weights with a flat head, so that drafter and verifier differ and the
    strings vary; recording the unmasked q instead puts the distance above 0.3)."""
    from collections import Counter

    import torch

    lm = loaded(attention="prefix_causal", initializer_range=0.5)
    with torch.no_grad():
        lm.model.lm_head.weight.div_(16)
    llm = LLM(lm, max_batch_size=64, default_drafts="on")
    c = Constraint("regex", "[a-c][a-c]")
    N = 400
    for prompt in ("Paris", "The quick brown fox"):
        def dist(**kw):
            outs = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=5, constraint=c, **kw),
                                n=N)[0].outputs
            assert all(re.fullmatch("[a-c][a-c]", o.text) for o in outs)
            return Counter(o.text for o in outs), outs

        spec, outs = dist(speculative=True, block_size=4)
        ar, _ = dist(speculative=False, block_size=1)
        assert sum(o.drafts_accepted for o in outs) > N / 2
        tv = 0.5 * sum(abs(spec[k] - ar[k]) for k in set(spec) | set(ar)) / N
        assert tv < 0.1, (spec, ar)


@pytest.mark.slow
def test_real_model_schema_outputs_validate_on_every_path():
    """SmolLM2 (the converted default model): llguidance reads its tokenizer; a chat prompt under a schema
    validates on the plain, threshold and speculative paths, and speculative greedy = constrained block 1."""
    from unmask.engine.model import load_model
    from unmask.training import realmodel

    try:
        path = realmodel.ensure_default_converted()
    except realmodel.RealModelMissing as exc:
        pytest.skip(str(exc))
    llm = LLM(load_model(str(path), device="cpu", dtype="float32"), default_drafts="on")
    ids = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON with name and age."}])
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 24},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    c = Constraint("json_schema", schema)
    outs = {}
    for name, kw in {"b1": dict(block_size=1, speculative=False), "spec": dict(block_size=8, speculative=True),
                     "t0.9": dict(block_size=32, threshold=0.9, speculative=False)}.items():
        out = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0, constraint=c, **kw))[0].outputs[0]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        outs[name] = out
    assert outs["spec"].token_ids == outs["b1"].token_ids and outs["spec"].nfe < outs["b1"].nfe


def test_block_1_and_speculative_greedy_equal_a_reference_constrained_ar_decode(llms):
    """Reference: the causal forward of the prefix-causal model (= block 1 decoding), the grammar's mask, argmax,
    token by token. The engine's block-1 decoding (forced runs written without a forward) and speculative decoding
    give exactly these tokens."""
    import torch

    llm = llms["causal"]
    lm = llm.model
    c = Constraint("lark", tool_call_lark(TOOLS))
    prompt = llm.encode("The quick brown fox")
    g = compile_constraint(c, lm.tokenizer, lm.vocab_size, lm.dllm.eos_token_ids)
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < 96:
            logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logits[lm.dllm.never_generate_ids] = float("-inf")
            token = int(torch.argmax(logits.masked_fill(~g.allowed(), float("-inf"))))
            assert g.consume([token]) == 1
            ids.append(token)
            if token in lm.dllm.eos_token_ids:
                break
    ref = ids[len(prompt):]
    for kw in (dict(block_size=1, speculative=False), dict(block_size=4, speculative=True)):
        out = llm.generate([prompt], SamplingParams(max_tokens=96, temperature=0, constraint=c, **kw))[0].outputs[0]
        assert out.token_ids == ref, kw
        assert out.nfe < len(ref)


def test_grammar_errors_carry_no_grammar_listing():
    """llguidance appends the grammar's lines and a caret to its error; a tool grammar embeds whole schemas, so the
    400 dumped internal grammar text (breaker). The message keeps the error itself."""
    from unmask.engine import check_constraint

    with pytest.raises(ParamError) as e:
        check_constraint(Constraint("lark", 'start: "a" body\nbody: %json {"type": "frobnicate"}\n', field="f"))
    msg = str(e.value)
    assert "frobnicate" in msg and "\n" not in msg and " | " not in msg and "%json" not in msg, msg


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
@pytest.mark.parametrize("max_tokens", [2, 4])
def test_a_constrained_output_cut_by_max_tokens_never_ends_in_a_broken_character(llms, kind, max_tokens):
    """The grammar forces "€" (3 byte tokens in the tiny BPE) repeatedly; max_tokens cuts inside a character. The
    text used to end in U+FFFD (breaker); the token ids stay (they were generated and count)."""
    llm = llms[kind]
    p = SamplingParams(max_tokens=max_tokens, temperature=0, seed=0, constraint=Constraint("regex", "(€)+"))
    out = llm.generate([[5, 6]], p)[0].outputs[0]
    ids = [t for t in out.token_ids if not out.ended_by_eos or t != out.token_ids[-1]]
    assert "\ufffd" not in out.text and len(out.token_ids) <= max_tokens, out
    assert out.text == "€" * (len(ids) // 3), out


def test_stop_checker_texts_hold_no_broken_character():
    from unmask.engine.stopping import StopChecker

    tok = loaded(block_size=4).tokenizer
    e, euro, x = tok.encode("é", add_special_tokens=False), tok.encode("€", add_special_tokens=False), \
        tok.encode("x", add_special_tokens=False)
    assert len(euro) == 3  # the premise: a character of several byte tokens
    by_length = StopChecker(tok, [], 0, set(), max_tokens=len(e) + 1)
    assert by_length.update(e + euro[:1], False) == ("length", e + euro[:1], "é")
    # before a stop string the text is the decoded text cut at the stop, as without the stop: bytes that text
    # follows were never a character cut by the end (tests/server/test_server.py joined deltas == plain text)
    by_stop = StopChecker(tok, ["x"], 0, set(), max_tokens=16)
    reason, ids, text = by_stop.update(e + euro[:2] + x, False)
    assert reason == "stop" and text == "é\ufffd" == tok.decode(e + euro[:2]), text
