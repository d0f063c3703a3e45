"""Per-request grammar state (llguidance's ``LLMatcher``) and the factory that compiles it.

One :class:`GuideFactory` per engine holds the tokenizer view and a cache of compiled
grammars; each structured request gets its own :class:`Guide`, which says which token
ids may come next (a bitmask, see :mod:`.masks`) and advances with every sampled token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from shardspeed.inference.fastgen.structured.params import StructuredOutputParams
from shardspeed.inference.fastgen.structured.tokenizer import build_ll_tokenizer, require_llguidance

# JSON as Python's json.dumps writes it: ", " and ": " separators, no other whitespace
# (a schema's own "x-guidance" options override these).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_CACHED_GRAMMARS = 256


class Guide:
    """The grammar state of one request (one sample of it).

    ``num_accepted`` counts the tokens it has taken (a mask computed at another count is
    stale). While the engine's mask prefetcher computes this guide's next mask on its
    worker thread (``in_flight``), llguidance holds the matcher borrowed: every method here
    first waits for that computation (:meth:`settle`).
    """

    def __init__(self, matcher: Any, factory: GuideFactory) -> None:
        self.matcher = matcher
        self.factory = factory
        self.num_accepted = 0
        self.in_flight: Future[Any] | None = None

    def settle(self) -> None:
        """Wait until no prefetched mask computation reads this guide's matcher."""
        pending = self.in_flight
        if pending is not None:
            self.in_flight = None
            futures.wait([pending])  # its outcome (or error) is the prefetcher's to report

    @property
    def is_finished(self) -> bool:
        """True when the grammar takes no more tokens (its output is complete)."""
        self.settle()
        return bool(self.matcher.is_stopped())

    def accept(self, token: int) -> None:
        """Advance by the sampled ``token``; ``ValueError`` if the grammar rejects it."""
        self.settle()
        self.num_accepted += 1
        if not self.matcher.consume_token(int(token)):
            raise ValueError(
                f"structured output: token {token} does not continue the grammar "
                f"({self.matcher.get_error() or 'rejected'})"
            )

    def fresh(self) -> Guide:
        """A copy at this guide's state (for another sample of the same prompt)."""
        self.settle()
        copy = Guide(self.matcher.deep_copy(), self.factory)
        copy.num_accepted = self.num_accepted
        return copy


class GuideFactory:
    """Compiles :class:`StructuredOutputParams` into :class:`Guide` objects for one engine.

    The llguidance tokenizer is built on first use (a few ms for a 32k vocabulary) and
    compiled grammars are cached by constraint, so identical schemas compile once.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self.virtual_eos: int | None = None
        self._executor: Any = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # add_request may run on the server's threads

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer, self.virtual_eos = build_ll_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._ll_tokenizer

    @property
    def executor(self) -> Any:
        """llguidance's thread pool computing the masks of a batch in parallel."""
        if self._executor is None:
            self._executor = require_llguidance().LLExecutor()
        return self._executor

    def new_guide(self, params: StructuredOutputParams) -> Guide:
        """A guide at the start of ``params``' grammar; ``ValueError`` naming the constraint
        and llguidance's message if it does not compile."""
        llg = require_llguidance()
        params.validate()
        with self._lock:
            tokenizer = self.ll_tokenizer
            grammar = self._grammar(params, tokenizer)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"structured output {params.kind} cannot be compiled: {matcher.get_error()}"
            )
        return Guide(matcher, self)

    def _grammar(self, params: StructuredOutputParams, tokenizer: Any) -> str:
        key = params.cache_key()
        cached = self._grammars.get(key)
        if cached is not None:
            self._grammars.move_to_end(key)
            return cached
        grammar = _compile(params)
        error = require_llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(
                f"structured output {params.kind} is invalid: {error.strip()}; fix the "
                f"{_FIELD_NAMES[params.kind]} and send it again."
            )
        self._grammars[key] = grammar
        while len(self._grammars) > _MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar


_FIELD_NAMES = {
    "json": "JSON schema",
    "json_object": "json_object request",
    "regex": "regular expression",
    "grammar": "grammar (Lark or GBNF)",
    "choice": "list of choices",
}


def _compile(params: StructuredOutputParams) -> str:
    """llguidance's grammar text for ``params`` (``ValueError`` on malformed input)."""
    llg = require_llguidance()
    matcher_cls = llg.LLMatcher
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return matcher_cls.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return matcher_cls.grammar_from_json_schema(
                '{"type": "object"}', defaults=JSON_DEFAULTS
            )
        if kind == "regex":
            return matcher_cls.grammar_from_regex(params.regex)
        if kind == "grammar":
            return llg.grammar_from("grammar", params.grammar)
        return llg.grammar_from("choice", json.dumps(params.choice))
    except ValueError as exc:
        raise ValueError(
            f"structured output {kind} is invalid: {exc}; fix the {_FIELD_NAMES[kind]}."
        ) from exc
