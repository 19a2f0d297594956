"""Quality measures for generated answers (issue 5, docs/design.md#measuring "Quality of a diffusion model").

Pure-Python functions over strings and token-id lists, plus one torch helper (:func:`continuation_nll`) that
scores generated tokens under the AR parent for generative perplexity. Used by :mod:`unmask.cli.evaluation.quality`
(``unmask eval``).

Definitions (sources):

* :func:`normalize_answer` / :func:`exact_match` -- SQuAD-style normalisation (Rajpurkar et al. 2016,
  ``evaluate-v1.1.py``: lowercase, drop punctuation and the articles a/an/the, collapse whitespace) plus number
  normalisation (thousands separators removed, ``3.50`` -> ``3.5``, ``7.0`` -> ``7``, number words zero..twenty ->
  digits) so that "Seven." and "7" match.
* :func:`contains_answer` -- a lenient variant: the normalised answer occurs as a whole-word span of the
  normalised prediction (reported beside exact match, never instead of it).
* :func:`answer_match` -- answer extraction for chatty outputs ("3 minutes is 3 * 60 = 180 seconds."): exact
  match, else for a numeric answer the *last* number of the output (GSM8K-style final-answer extraction, Cobbe et
  al. 2021), else for a word answer :func:`contains_answer`. Reported as "answer accuracy" beside strict exact match.
* :func:`token_f1` -- SQuAD bag-of-words F1 between a prediction and a reference (here: the parent's greedy
  answer), on words normalised the same way (articles kept: they carry agreement between two free answers).
* :func:`repeated_ngram_rate` -- share of a sequence's n-grams that repeat an earlier n-gram of the same sequence
  (``1 - unique/total``), the repetition measure shown beside perplexity (docs/design.md#decisions).
* :func:`distinct_n` -- corpus-level distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function"):
  unique n-grams / total n-grams over all outputs of one run.
* :func:`generative_perplexity` -- ``exp(sum NLL / sum tokens)`` of the generated tokens under the AR parent,
  conditioned on the prompt (token-weighted over the run; EOS included when generated).
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_ARTICLES = {"a", "an", "the"}
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|[-+]?\d+(?:\.\d+)?")
_APOSTROPHE_IN_WORD = re.compile(r"(?<=[^\W\d_])['\u2019](?=[^\W\d_])")
_PUNCT = set(string.punctuation) | {"\u2018", "\u2019", "\u201c", "\u201d", "\u2013", "\u2014", "\u2026"}


def _canon_number(text: str) -> str:
    """``'1,000.50'`` -> ``'1000.5'``; ``'7.0'`` -> ``'7'``; ``'-3'`` -> ``'-3'``."""
    t = text.replace(",", "")
    sign = "-" if t.startswith("-") else ""
    t = t.lstrip("+-")
    if "." in t:
        t = t.rstrip("0").rstrip(".")
    t = t.lstrip("0") or "0"
    if t.startswith("."):
        t = "0" + t
    return sign + t if t != "0" else "0"


def _words(text: str, drop_articles: bool) -> list[str]:
    """Lowercased words with numbers canonicalised and punctuation removed (a number's decimal point kept)."""
    if not isinstance(text, str):
        raise TypeError(f"expected a string, got {type(text).__name__}")
    text = text.lower()
    numbers: list[str] = []

    def keep(m: re.Match) -> str:
        numbers.append(_canon_number(m.group(0)))
        return f" \x00{len(numbers) - 1}\x00 "

    text = _NUMBER.sub(keep, text)
    text = _APOSTROPHE_IN_WORD.sub("", text)  # "i'm" -> "im", "it's" -> "its" (not "i m": no 1-letter words)
    text = "".join(" " if ch in _PUNCT else ch for ch in text)
    out: list[str] = []
    for w in text.split():
        m = re.fullmatch(r"\x00(\d+)\x00", w)
        if m:
            out.append(numbers[int(m.group(1))])
        elif w in NUMBER_WORDS:
            out.append(NUMBER_WORDS[w])
        elif drop_articles and w in _ARTICLES:
            continue
        else:
            out.append(w)
    return out


def normalize_answer(text: str) -> str:
    """Normalised form used for exact match: lowercase, punctuation and articles removed, numbers canonical,
    whitespace collapsed. ``"The answer is 1,000.0!"`` -> ``"answer is 1000"``.

    Raises:
        TypeError: ``text`` is not a string.
    """
    return " ".join(_words(text, drop_articles=True))


def exact_match(prediction: str, answer: str) -> bool:
    """True when the normalised prediction equals the normalised answer."""
    return normalize_answer(prediction) == normalize_answer(answer)


def contains_answer(prediction: str, answer: str) -> bool:
    """True when the normalised answer occurs as a contiguous whole-word span of the normalised prediction
    (lenient match; ``"The capital is Oslo."`` contains ``"Oslo"``, ``"150"`` does not contain ``"15"``).
    An empty answer never matches."""
    p, a = _words(prediction, True), _words(answer, True)
    if not a:
        return False
    return any(p[i:i + len(a)] == a for i in range(len(p) - len(a) + 1))


def _is_number(w: str) -> bool:
    return re.fullmatch(r"-?\d+(?:\.\d+)?", w) is not None


def answer_match(prediction: str, answer: str) -> bool:
    """Extracted-answer match: :func:`exact_match`; else, when the normalised answer is one number, the last
    number in the prediction equals it - the last number written in digits when there is one (so that "one" the
    pronoun after the result does not count), else the last number word; else :func:`contains_answer`."""
    if exact_match(prediction, answer):
        return True
    a = _words(answer, True)
    if len(a) == 1 and _is_number(a[0]):
        if not isinstance(prediction, str):
            raise TypeError(f"expected a string, got {type(prediction).__name__}")
        digits = [_canon_number(m.group(0)) for m in _NUMBER.finditer(prediction.lower())]
        nums = digits or [w for w in _words(prediction, True) if _is_number(w)]
        return bool(nums) and nums[-1] == a[0]
    return contains_answer(prediction, answer)


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD bag-of-words F1 in [0, 1] between two texts (both empty -> 1.0, one empty -> 0.0)."""
    p, r = _words(prediction, False), _words(reference, False)
    if not p and not r:
        return 1.0
    if not p or not r:
        return 0.0
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def _ngrams(tokens: Sequence, n: int) -> list[tuple]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def repeated_ngram_rate(tokens: Sequence, n: int = 3) -> float | None:
    """Share of the n-grams of one sequence that repeat an earlier n-gram of it: ``1 - unique / total``, in [0, 1).

    Args:
        tokens: token ids (or words) of one output. n: n-gram length (>= 1).

    Returns:
        the rate, or None when the sequence has fewer than ``n`` tokens (no n-gram to judge).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    grams = _ngrams(list(tokens), n)
    if not grams:
        return None
    return 1.0 - len(set(grams)) / len(grams)


def distinct_n(sequences: Iterable[Sequence], n: int = 2) -> float | None:
    """Corpus-level distinct-n (Li et al. 2016): unique n-grams / total n-grams over all sequences (n-grams never
    cross sequence boundaries). None when there is no n-gram at all.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    total, uniq = 0, set()
    for seq in sequences:
        grams = _ngrams(list(seq), n)
        total += len(grams)
        uniq.update(grams)
    return len(uniq) / total if total else None


def short_output_rate(lengths: Iterable[int], max_len: int = 4) -> float | None:
    """Share of outputs with at most ``max_len`` generated tokens (EOS included): a model that stops after a word
    or two wins on EOS rate and corpus-level distinct-n without answering, so those two measures are only
    comparable between models with similar values here. None for no outputs.

    Raises:
        ValueError: ``max_len < 0``.
    """
    if max_len < 0:
        raise ValueError(f"max_len: must be >= 0, got {max_len}")
    v = list(lengths)
    return sum(1 for n in v if n <= max_len) / len(v) if v else None


def generative_perplexity(nll_sums: Sequence[float], counts: Sequence[int]) -> float | None:
    """Token-weighted perplexity ``exp(sum(nll) / sum(counts))`` over a run (nll in nats). None when no tokens.

    Raises:
        ValueError: lengths differ, or a count is negative.
    """
    if len(nll_sums) != len(counts):
        raise ValueError(f"nll_sums has {len(nll_sums)} entries but counts has {len(counts)}")
    if any(c < 0 for c in counts):
        raise ValueError("counts: must be >= 0")
    n = sum(counts)
    return math.exp(sum(nll_sums) / n) if n else None


def continuation_nll(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float:
    """Sum of the negative log-likelihoods (nats, float64 sum of float32 log-softmax) of ``output_ids`` given
    ``prompt_ids`` under a causal LM (the AR parent), in one teacher-forced forward of ``prompt + output``.

    Args:
        model: a transformers causal LM (returns ``.logits`` ``[1, L, V]``), in eval mode.
        prompt_ids: the prompt's ids (non-empty). output_ids: the generated ids (may be empty -> 0.0).

    Raises:
        ValueError: empty prompt, or an id outside the model's vocabulary.
    """
    import torch

    if not prompt_ids:
        raise ValueError("prompt_ids: must not be empty (the first output token needs a context)")
    if not output_ids:
        return 0.0
    ids = list(prompt_ids) + list(output_ids)
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = [t for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary ({vocab} rows)")
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float()
    p = len(prompt_ids)
    logp = torch.log_softmax(logits[p - 1:-1], dim=-1)
    target = x[0, p:]
    return float(-logp.gather(1, target[:, None]).double().sum())
