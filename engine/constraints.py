"""Grammar constraints compiled with llguidance, and the per-choice grammar state (docs/design.md#constrained-decoding).

A :class:`~unmask.engine.params.Constraint` (``json_object`` / ``json_schema`` / ``lark`` / ``regex``) becomes an
llguidance grammar (``LLMatcher.grammar_from_*``), compiled once per (tokenizer, vocabulary size, EOS ids, spec)
into a template matcher (:func:`compile_constraint`, an LRU cache); every choice gets a deep copy of it
(:class:`GrammarState`, ~2 us). Compilation, its checks (:mod:`.grammar_checks`) and each choice's first mask run
when the request is built (``unmask.engine.request.Request``), never inside a decoding step; a step's forced run is
capped (:data:`MAX_FORCED_PER_STEP`).

JSON is generated compactly but readably: ``", "`` and ``": "`` between items and keys, no other whitespace
(``whitespace_flexible: false``), so a model cannot pad forever; a schema's ``x-guidance`` key overrides that, as
llguidance documents.

The state follows the revealed left-to-right prefix of the generation region: :meth:`GrammarState.allowed` gives
the ``[V]`` bool mask of tokens allowed next (only EOS once the grammar is complete), :meth:`GrammarState.consume`
advances it, :meth:`GrammarState.push` / :meth:`GrammarState.pop` try tokens and roll them back (parallel reveals
and speculative drafts are checked against the grammar before they are kept).

Errors: :class:`~unmask.engine.limits.ParamError` naming the constraint's ``field`` (``response_format``,
``tool_choice``) for an invalid schema, grammar or regex, integer bounds llguidance cannot handle, a grammar that
fails or allows nothing in its first mask or forced tokens, or a tokenizer llguidance cannot read.
"""
from __future__ import annotations

import functools
import threading
import weakref

import numpy as np
import torch

from .limits import ParamError
from .params import Constraint
from .grammar_checks import check_integer_bounds, first_lines, probe
from .heap import return_freed_memory

__all__ = ["GrammarState", "compile_constraint", "check_constraint", "grammar_text", "JSON_OPTIONS"]

#: llguidance JSON compile defaults (a schema's own ``x-guidance`` overrides them)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_lock = threading.Lock()  # compilation may run on the event loop thread and the engine thread at once
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _llg():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the HF tokenizer bridge)
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise RuntimeError("constrained decoding needs the llguidance package (pip install llguidance)") from e
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON grammar text) of ``constraint``; not validated yet."""
    llg = _llg()
    m = llg.LLMatcher
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        check_integer_bounds(spec, constraint.field)  # llguidance crashes on some (the process dies)
    try:
        if kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            return m.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "lark":
            return m.grammar_from_lark(spec)
        return m.grammar_from_regex(spec)
    except (ValueError, TypeError) as e:
        raise ParamError(constraint.field, f"invalid {kind} constraint: {e}") from None


def check_constraint(constraint: Constraint) -> None:
    """Validate ``constraint``'s grammar without a tokenizer (for callers that want the 400 before the request
    reaches an engine). Raises :class:`ParamError` naming ``constraint.field``."""
    _validated(constraint, None)


def _validated(constraint: Constraint, tokenizer) -> str:
    llg = _llg()
    text = grammar_text(constraint)
    message = llg.LLMatcher.validate_grammar(text, tokenizer)
    if message and not message.startswith("WARNING"):
        raise ParamError(constraint.field, f"invalid {constraint.kind} constraint: {first_lines(message)}")
    return text


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """The llguidance tokenizer of a Hugging Face fast tokenizer (cached per tokenizer object; building one takes
    ~5 ms for a tiny vocabulary, ~1 s for a large one).

    Args:
        tokenizer: a ``transformers.PreTrainedTokenizerFast``. vocab_size: the LM head's rows (the logits' width;
            rows past the tokenizer are never allowed). eos_ids: the ids that end the output (the grammar allows
            them where it may stop).

    Raises:
        ParamError: (``response_format``) the tokenizer is not a fast tokenizer llguidance can read.
    """
    llg = _llg()
    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        key = (int(vocab_size), tuple(eos_ids))
        if key not in per:
            try:
                n_vocab = max(int(vocab_size), len(tokenizer))
                per[key] = llg.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos_ids))
            except (ValueError, TypeError) as e:
                raise ParamError("response_format", f"constrained decoding needs a fast (Rust) tokenizer that "
                                                    f"llguidance can read: {e}") from None
        return per[key]


#: compiled templates kept (each holds the lexer states its first masks built: up to tens of MB for a grammar near
#: llguidance's limits, so the count is small; a grammar llguidance gives up on is refused and never cached)
CACHE_ENTRIES = 32


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _compiled(lltok, key: tuple[str, str], constraint: Constraint):
    llg = _llg()
    text = _validated(constraint, lltok)
    matcher = llg.LLMatcher(lltok, text, log_level=0)
    # the first mask builds the lexer's initial automaton (seconds for a huge regex): here, at submit, off the
    # event loop and the engine thread; deep copies start from it. It also refuses a grammar llguidance gives up
    # on and one no output satisfies (its first mask allows nothing and it does not accept the empty output).
    # A copy then follows the tokens the grammar forces (up to grammar_checks.PROBE_FORCED): a grammar failing there (a
    # recursion that must nest forever, llguidance's item limit) fails every request, so it is refused too.
    probe(matcher, constraint, 0)
    probe(matcher.deep_copy(), constraint)
    return matcher


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int, eos_ids) -> "GrammarState":
    """A fresh :class:`GrammarState` for one choice (the compiled template matcher is cached by tokenizer and
    :meth:`Constraint.key`; a request with the same spec compiles nothing).

    Args:
        constraint: the request's constraint. tokenizer: the model's HF fast tokenizer. vocab_size: logits width.
        eos_ids: ids that end the output (the model's EOS / end-of-turn ids and ``stop_token_ids``).

    Raises:
        ParamError: naming ``constraint.field``: invalid schema / grammar / regex.
    """
    eos = tuple(sorted(set(int(t) for t in eos_ids)))
    if not eos:
        raise ParamError(constraint.field, "a constraint needs an end-of-sequence token to end the output "
                                           "(the model declares no EOS id)")
    lltok = ll_tokenizer(tokenizer, vocab_size, eos)
    with _lock:
        built = _compiled.cache_info().misses
        try:
            template = _compiled(lltok, constraint.key(), constraint)
        finally:  # a grammar was built (kept or refused): its transient automata back to the system (engine/heap.py)
            if _compiled.cache_info().misses != built:
                return_freed_memory()
    state = GrammarState(template.deep_copy(), int(vocab_size), eos)
    state.allowed()  # the copy's first mask, computed here (at submit) rather than in the first step
    if state.error:  # llguidance gave up (a resource limit) or nothing satisfies the grammar: a 400, not EOS
        raise ParamError(constraint.field, f"invalid {constraint.kind} constraint: {state.error}")
    return state


class GrammarState:
    """The grammar state of one choice: the llguidance matcher after the consumed (revealed, left-to-right)
    tokens.

    Args:
        matcher: an ``llguidance.LLMatcher`` (a deep copy of the compiled template).
        vocab_size: the logits' width V. eos_ids: the EOS ids (the only tokens allowed once the grammar is done).
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long)
        self._eos = frozenset(eos_ids)
        self.consumed = 0   # tokens consumed for good (the revealed prefix)
        self.done = False   # an EOS was consumed: nothing but EOS follows
        self._pushed: list[tuple[bool, bool]] = []  # per tried token: (matcher consumed it, done before it)
        self.n_allowed = 0  # tokens the last allowed() mask allowed (1 = the grammar forces the token)
        self._first: tuple[torch.Tensor, int] | None = None  # the first mask, kept until a token is pushed
        self.error: str | None = None  # why the last mask allowed nothing (llguidance error / unsatisfiable)

    def is_eos(self, token: int) -> bool:
        """Whether ``token`` is one of the EOS ids."""
        return int(token) in self._eos

    @property
    def pushed(self) -> int:
        """Tokens tried on top of the consumed ones (see :meth:`push`)."""
        return len(self._pushed)

    def allowed(self) -> torch.Tensor:
        """``[V]`` bool (CPU): the tokens the grammar allows next (their count in :attr:`n_allowed`). Only EOS
        once the grammar is complete or an EOS was consumed; EOS alone too if the matcher is in an error state (a
        bug; the output then ends). Costs one llguidance mask (~10 us) and an unpack (~40 us at V = 49k)."""
        if self._first is not None:
            self.n_allowed = self._first[1]
            return self._first[0].clone()
        out = self._mask()
        if not self.pushed and not self.consumed and not self.done:
            self._first = (out.clone(), self.n_allowed)
        return out

    def _mask(self) -> torch.Tensor:
        V = self.vocab_size
        raw = None if self.done or self.matcher.is_error() or self.matcher.is_stopped() else \
            self.matcher.compute_bitmask()
        count = int.from_bytes(raw, "little").bit_count() if raw is not None else 0
        self.error = None
        if not count and not self.done and not (self.matcher.is_accepting() or self.matcher.is_stopped()):
            self.error = (first_lines(self.matcher.get_error()) if self.matcher.is_error() else
                          "no output satisfies it (its grammar allows no next token)")
        if not count:  # complete, or (self.error) the grammar failed: EOS only, and the caller reads .error
            out = torch.zeros(V, dtype=torch.bool)
            out[self.eos_ids] = True
            self.n_allowed = int(out.sum())
            return out
        self.n_allowed = count
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")  # bit j of word w = token 32w+j
        bits = bits[:V] if bits.size >= V else np.concatenate([bits, np.zeros(V - bits.size, dtype=np.uint8)])
        return torch.from_numpy(bits.view(np.bool_))

    def push(self, token: int) -> bool:
        """Try ``token`` after the consumed and pushed tokens; ``True`` (and pushed) when the grammar allows it,
        ``False`` (state unchanged) otherwise. An EOS is allowed where the grammar may stop."""
        token = int(token)
        self._first = None
        was_done = self.done
        if was_done:
            ok, used = token in self._eos, False
        elif token in self._eos:
            ok, used = self.matcher.is_accepting() or self.matcher.is_stopped(), False
            self.done = ok
        else:
            ok, used = self.matcher.try_consume_tokens([token]) == 1, True
        if ok:
            self._pushed.append((used, was_done))
        return ok

    def pop(self, n: int | None = None) -> None:
        """Roll back the last ``n`` pushed tokens (all when ``None``)."""
        for _ in range(self.pushed if n is None else n):
            used, was_done = self._pushed.pop()
            if used:
                self.matcher.rollback(1)
            self.done = was_done

    def commit(self) -> None:
        """Keep the pushed tokens (they are revealed now)."""
        self.consumed += self.pushed
        self._pushed.clear()

    def consume(self, tokens) -> int:
        """Consume ``tokens`` for good (revealed tokens, left to right); returns how many the grammar accepted
        (all of them unless a caller revealed a token the grammar forbids, which the strategies never do)."""
        n = 0
        for t in tokens:
            if not self.push(int(t)):
                break
            n += 1
        self.commit()
        return n


#: forced tokens one step reveals at most: each costs a mask (microseconds for usual grammars, up to ~0.1 s for a
#: huge regex), and a step runs on the engine thread, so the run is cut and resumed next step, letting other
#: requests' steps interleave (docs/design.md#constrained-decoding)
MAX_FORCED_PER_STEP = 16


def forced_run(grammar: GrammarState, limit: int) -> list[int]:
    """The tokens the grammar forces after its consumed prefix (each the only token its mask allows; an
    EOS-only mask does not count: the model picks among the EOS ids), at most ``limit`` and
    :data:`MAX_FORCED_PER_STEP`; consumed. They are final
    whatever the model would say, so the strategies reveal them without a forward of their own."""
    out: list[int] = []
    limit = min(limit, MAX_FORCED_PER_STEP)
    while len(out) < limit:
        allowed = grammar.allowed()
        if grammar.n_allowed != 1:
            break
        token = int(allowed.nonzero()[0, 0])
        if grammar.is_eos(token) or not grammar.push(token):
            break
        out.append(token)
    grammar.commit()
    return out
