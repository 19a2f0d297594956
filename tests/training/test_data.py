"""Training data: chat rendering, assistant-only labels, truncation, errors with file:line, teacher alignment."""
from __future__ import annotations

import json

import pytest

import tiny
from unmask.training.data import DataError, collate, eos_ids_of, load_dataset
from unmask.training.distill import done_keys, read_prompts


@pytest.fixture(scope="module")
def tok():
    return tiny.make_tokenizer(320, mask_token="[MASK]")


def _write(path, lines):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode())
                              + b"\n" for x in lines))
    return path


def test_multi_turn_labels_only_assistant_with_end_of_turn(tmp_path, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! Grüße"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "four"}]
    f = _write(tmp_path / "d.jsonl", [{"messages": msgs}, {"prompt": "Name a fox.", "completion": "quick brown"}])
    ds = load_dataset(f, tok, 256)
    ex = ds.examples[0]
    texts = [tok.decode(ex.input_ids[s:e]) for s, e in ex.spans]
    assert texts == ["Hello! Grüße<|im_end|>", "four<|im_end|>"]
    labelled = tok.decode([t for t, a in zip(ex.input_ids, ex.answer) if a])
    assert labelled == "Hello! Grüße<|im_end|>four<|im_end|>"
    assert "Hi there" not in labelled and "assistant" not in labelled
    ex2 = ds.examples[1]
    assert tok.decode([t for t, a in zip(ex2.input_ids, ex2.answer) if a]) == "quick brown<|im_end|>"
    # the prompt part is exactly the engine's chat prompt
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a fox."}], tokenize=False,
                                     add_generation_prompt=True)
    assert ex2.input_ids[: ex2.spans[0][0]] == tok(prompt, add_special_tokens=False).input_ids
    b = collate(ds.examples, pad_id=0)
    assert b.answer.sum().item() == sum(e.n_answer for e in ds.examples)
    assert not b.answer[~b.valid].any()


def test_truncation_never_crosses_and_drops_answerless(tmp_path, tok):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 6
    f = _write(tmp_path / "d.jsonl", [{"prompt": long_prompt, "completion": "ok"},
                                      {"prompt": "Hi", "completion": "Diffusion language models unmask tokens."}])
    ds = load_dataset(f, tok, 24)
    assert ds.dropped == 1 and len(ds) == 1
    assert len(ds.examples[0].input_ids) == 24 and ds.examples[0].spans[0][1] == 24
    with pytest.raises(DataError, match="no assistant tokens"):
        load_dataset(_write(tmp_path / "x.jsonl", [{"prompt": long_prompt, "completion": "ok"}]), tok, 24)


@pytest.mark.parametrize("line, reason", [
    ("{not json", "invalid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"text": "hi"}', "expected `messages` or `prompt`"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\].content"),
    ('{"prompt": 1, "completion": "x"}', "`prompt` must be a string"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [1], "teacher": {"ids": [[1], [2]], "logprobs": [[0]]}}',
     "teacher"),
    # malformed teacher rows used to pass loading and fail mid-training (or with a bare traceback)
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 2], "teacher": {"ids": [1, 2], "logprobs": [0, 0]}}',
     "teacher"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 2], '
     '"teacher": {"ids": [[1], [2]], "logprobs": [["x"], [0.0]]}}', "logprobs must be numbers"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 2], '
     '"teacher": {"ids": [[999999], [2]], "logprobs": [[0.0], [0.0]]}}', "token ids in"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 2], '
     '"teacher": {"ids": [[-1], [2]], "logprobs": [[0.0], [0.0]]}}', "token ids in"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 2], "teacher": {"ids": [[], []], "logprobs": [[], []]}}',
     "top-k >= 1"),
    ('{"prompt": "a", "completion": "b", "completion_ids": [5, 999999]}', "completion_ids"),
    (b'{"prompt": "\xff", "completion": "a"}', "not UTF-8"),
    ("[" * 100000, "invalid JSON"),
])
def test_bad_line_names_file_and_line(tmp_path, tok, line, reason):
    f = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, "", line])
    with pytest.raises(DataError, match=rf"bad.jsonl:3: .*{reason}"):
        load_dataset(f, tok, 64)


def test_empty_file_and_missing(tmp_path, tok):
    with pytest.raises(DataError, match="empty file"):
        load_dataset(_write(tmp_path / "e.jsonl", ["", "  "]), tok, 64)
    with pytest.raises(DataError, match="no such file"):
        load_dataset(tmp_path / "nope.jsonl", tok, 64)


def test_distill_records_align_teacher_topk(tmp_path, tok):
    cids = tok("quick brown", add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    k = 3
    rec = {"prompt": "Name a fox.", "completion": "quick brown", "completion_ids": cids, "finished": True,
           "teacher": {"top_k": k, "ids": [[c, 1, 2] for c in cids], "logprobs": [[-0.1, -3.0, -4.0]] * len(cids)}}
    ds = load_dataset(_write(tmp_path / "d.jsonl", [rec]), tok, 64)
    ex = ds.examples[0]
    assert ds.teacher_top_k == k
    s, e = ex.spans[0]
    assert ex.input_ids[s:e] == cids and len(ex.teacher_ids) == len(cids)
    b = collate(ds.examples, pad_id=0, top_k=k)
    assert b.has_teacher[0].tolist() == b.answer[0].tolist()
    assert b.teacher_ids[0, s:e, 0].tolist() == cids
    # distill-data's resume bookkeeping: done prompts are skipped, a torn last line is dropped
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(rec) + "\n" + '{"prompt": "tor')
    keys = done_keys(out)
    assert keys == {json.dumps("Name a fox.")} and out.read_text().endswith("\n")
    pf = _write(tmp_path / "p.jsonl", [{"prompt": "Name a fox."}, {"messages": [{"role": "user", "content": "x"}]}])
    assert [p["key"] in keys for p in read_prompts(pf)] == [True, False]
    # blank lines are skipped and nothing after them is lost; a bad line in the middle is an error, not a cut
    r2 = {**rec, "prompt": "Second."}
    text = json.dumps(rec) + "\n\n" + json.dumps(r2) + "\n"
    out.write_text(text)
    assert done_keys(out) == {json.dumps("Name a fox."), json.dumps("Second.")} and out.read_text() == text
    for bad, why in (("{oops", "not a JSON line"), ("[1]", "expected a JSON object")):
        out.write_text(json.dumps(rec) + "\n" + bad + "\n" + json.dumps(r2) + "\n")
        before = out.read_bytes()
        with pytest.raises(DataError, match=f"out.jsonl:2: {why}"):
            done_keys(out)
        assert out.read_bytes() == before
    assert set(eos_ids_of(tok)) >= {tok.convert_tokens_to_ids("<|im_end|>")}


def test_template_without_end_of_turn_gets_eos_after_each_answer(tmp_path):
    tok = tiny.make_tokenizer(320, mask_token="[MASK]")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More"}, {"role": "assistant", "content": "quick fox"}]
    ds = load_dataset(_write(tmp_path / "d.jsonl", [{"messages": msgs}]), tok, 128)
    ex = ds.examples[0]
    assert [tok.decode(ex.input_ids[s:e]) for s, e in ex.spans] == ["Hello\n<|endoftext|>", "quick fox\n<|endoftext|>"]


def test_chat_opening_with_an_assistant_turn_labels_only_its_content(tmp_path, tok):
    """The first assistant turn of a chat that starts with it used to be located from character 0, so the role
    header (or a template's system preamble) became a label."""
    msgs = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "four"}]
    ex = load_dataset(_write(tmp_path / "d.jsonl", [{"messages": msgs}]), tok, 256).examples[0]
    assert [tok.decode(ex.input_ids[s:e]) for s, e in ex.spans] == ["Hello<|im_end|>", "four<|im_end|>"]
    # a template that cannot render an empty chat (SmolLM2's reads messages[0]): the content is located instead
    strict = tiny.make_tokenizer(320, mask_token="[MASK]")
    strict.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nPreamble<|im_end|>\n"
                            "{% endif %}" + strict.chat_template)
    ex = load_dataset(_write(tmp_path / "e.jsonl", [{"messages": msgs}]), strict, 256).examples[0]
    labelled = strict.decode([t for t, a in zip(ex.input_ids, ex.answer) if a])
    assert labelled == "Hello<|im_end|>four<|im_end|>"
