"""What a request's output must match: a JSON schema, any JSON object, a regex, a grammar
or one of a list of strings (vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar``
/ ``guided_choice`` and OpenAI's ``response_format``).

Plain data, checked here for shape only; the grammar itself is compiled (and its errors
reported) by :class:`~.guide.GuideFactory` when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass
class StructuredOutputParams:
    """Exactly one of the constraints below.

    Attributes:
        json: a JSON schema (dict or its JSON text); the output is one JSON value
            that validates against it.
        json_object: True => the output is one JSON object (any keys).
        regex: the output matches this regular expression (Rust ``regex`` syntax,
            anchored at both ends).
        grammar: a Lark grammar, or a GBNF (llama.cpp) grammar.
        choice: the output is exactly one of these strings.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    @property
    def kind(self) -> str:
        """Which constraint is set (``"json"``, ``"json_object"``, ``"regex"``...)."""
        set_kinds = self._set_kinds()
        return set_kinds[0] if set_kinds else "none"

    def _set_kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the constraint is missing or malformed."""
        set_kinds = self._set_kinds()
        if len(set_kinds) != 1:
            raise ValueError(
                f"StructuredOutputParams needs exactly one of {list(KINDS)}, got {set_kinds or 'none'}; "
                "set one, e.g. StructuredOutputParams(json={'type': 'object'})."
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(
                        f"StructuredOutputParams.json is not valid JSON text ({exc}); pass a "
                        "JSON schema as a dict or its JSON text."
                    ) from exc
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"StructuredOutputParams.json must be a JSON schema (an object), got "
                    f"{type(schema).__name__}."
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"StructuredOutputParams.{name}={value!r} must be a non-empty string."
                )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"StructuredOutputParams.choice={self.choice!r} must be a non-empty list of "
                    "non-empty strings."
                )

    def cache_key(self) -> tuple[str, str]:
        """A hashable key of the constraint (the compiled grammar is cached by it)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "choice") and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return kind, str(value)
