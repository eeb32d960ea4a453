"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, an EBNF
grammar or a choice among strings (vLLM's ``guided_*`` names). Plain data, no xgrammar."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused
MAX_JSON_NESTING = 128  # containers nested in a JSON schema (about 60 object levels)
MAX_JSON_VALUES = 100_000  # values (keys and entries included) in a JSON schema given as an object
MAX_CHOICES = 4096

KINDS = ("json", "json_object", "regex", "grammar", "choice")


def json_shape(value: Any) -> tuple[int, int]:
    """``(depth, values)``: how deeply dicts and lists nest in ``value`` and how many values it
    holds, a dict's keys included. Iterative, and it stops once either passes its limit
    (``MAX_JSON_NESTING``, ``MAX_JSON_VALUES``), so its cost is bounded whatever ``value`` is."""
    deepest, num_values = 0, 1
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
            num_values += 2 * len(item)
        elif isinstance(item, list):
            children = item
            num_values += len(item)
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_NESTING or num_values > MAX_JSON_VALUES:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest, num_values


@dataclass(slots=True)
class GuidedDecodingParams:
    """Constrain a request's output; set exactly one field.

    :param json: a JSON schema (a dict or its JSON text); the output is one JSON value valid
        against it, written without free whitespace.
    :param json_object: True: the output is any JSON object.
    :param regex: the output matches this regular expression (whole output).
    :param grammar: an EBNF (GBNF-style) grammar whose ``root`` rule the output follows.
    :param choice: the output is exactly one of these strings.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            if len(self.json) > MAX_SPEC_CHARS:
                raise ValueError(f"the JSON schema is {len(self.json)} characters; the limit is {MAX_SPEC_CHARS}")
            try:
                self.json = jsonlib.loads(self.json)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"guided_json is not valid JSON: {exc}") from exc
        if isinstance(self.json, bool):  # the JSON schemas true (any value) and false (none)
            if not self.json:
                raise ValueError("guided_json is the schema false, which no output matches")
            self.json = {}
        if self.json_object is False:
            self.json_object = None
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"guided_choice must be a list of strings, got {type(self.choice).__name__}")
            self.choice = list(self.choice)
        self.validate()

    @classmethod
    def from_value(cls, value: GuidedDecodingParams | dict[str, Any]) -> GuidedDecodingParams:
        """Accept the dataclass or its dict form (as sent in an HTTP body)."""
        if isinstance(value, GuidedDecodingParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"guided_decoding must be an object with one of {list(KINDS)}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"guided_decoding has unknown field(s) {unknown}; expected one of {list(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which field is set: ``"json"``, ``"json_object"``, ``"regex"``, ``"grammar"`` or ``"choice"``."""
        return next(name for name in KINDS if getattr(self, name) is not None)

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        given = [name for name in KINDS if getattr(self, name) is not None]
        check(len(given) == 1, f"guided decoding takes exactly one of {list(KINDS)}, got {given or 'none'}")
        if self.json is not None:
            check(isinstance(self.json, dict), f"guided_json must be a JSON schema object, got {type(self.json).__name__}")
            depth, num_values = json_shape(self.json)
            check(depth <= MAX_JSON_NESTING, f"the JSON schema nests deeper than {MAX_JSON_NESTING} levels; flatten it")
            check(num_values <= MAX_JSON_VALUES, f"the JSON schema holds more than {MAX_JSON_VALUES} values; simplify it")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                check(isinstance(value, str) and value != "", f"guided_{name} must be a non-empty string")
                check(len(value) <= MAX_SPEC_CHARS, f"guided_{name} is {len(value)} characters; the limit is {MAX_SPEC_CHARS}")
        if self.choice is not None:
            check(0 < len(self.choice) <= MAX_CHOICES, f"guided_choice needs 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            check(all(isinstance(c, str) and c for c in self.choice), "guided_choice entries must be non-empty strings")
            check(sum(len(c) for c in self.choice) <= MAX_SPEC_CHARS, f"guided_choice is longer than {MAX_SPEC_CHARS} characters")
        check(self.json_object in (None, True), "json_object must be true or left out")

    def cache_key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            return kind, jsonlib.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, jsonlib.dumps(self.choice)
        return kind, getattr(self, kind)
