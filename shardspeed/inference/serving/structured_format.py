"""Structured-output fields of the OpenAI API and vLLM's extensions.

OpenAI: ``response_format`` = ``{"type": "text"}`` | ``{"type": "json_object"}`` |
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``.
vLLM (sent through the openai client's ``extra_body``): ``guided_json`` (a schema),
``guided_regex``, ``guided_grammar`` (Lark or GBNF), ``guided_choice`` (a list of
strings). At most one constraint per request; each becomes a
:class:`~shardspeed.inference.fastgen.structured.StructuredOutputParams`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardspeed.inference.fastgen.structured.params import StructuredOutputParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


class StructuredOutputError(ValueError):
    """A malformed or conflicting structured-output field; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output (mixed into both endpoints' bodies)."""

    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def structured_output(self) -> tuple[str, StructuredOutputParams] | None:
        """The request's constraint and the field that sent it, None for free text;
        :class:`StructuredOutputError` (a 400 naming the field) when malformed or when two
        are sent."""
        found: list[tuple[str, StructuredOutputParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise StructuredOutputError(
                    'response_format: type "json_schema" needs json_schema.schema (a JSON '
                    'schema object), e.g. {"type": "json_schema", "json_schema": {"name": "x", '
                    '"schema": {"type": "object"}}}',
                    "response_format",
                )
            found.append(
                ("response_format", StructuredOutputParams(json=rf.json_schema.json_schema))
            )
        if self.guided_json is not None:
            found.append(("guided_json", StructuredOutputParams(json=self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutputParams(regex=self.guided_regex)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutputParams(grammar=self.guided_grammar)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutputParams(choice=self.guided_choice)))
        if len(found) > 1:
            names = [name for name, _ in found]
            raise StructuredOutputError(
                f"{' and '.join(names)} each constrain the output; send only one of them",
                names[1],
            )
        if not found:
            return None
        param, params = found[0]
        try:
            params.validate()
        except ValueError as exc:
            raise StructuredOutputError(f"{param}: {exc}", param) from exc
        return param, params
