"""A request's output constraint as an llguidance grammar for the engine
(:mod:`~moeinfra.engine.structured`), from the fields vLLM takes:

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"schema": ...}}``;
* ``structured_outputs`` (vLLM 0.11+): one of ``json`` (a schema), ``json_object``, ``regex``,
  ``choice`` (one of these strings), ``grammar`` (GBNF/EBNF as vLLM's default xgrammar backend
  reads it, or Lark as its guidance backend does), with ``disable_any_whitespace`` and
  ``whitespace_pattern``;
* vLLM 0.10's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
  ``guided_whitespace_pattern``.

JSON allows whitespace between tokens, as vLLM does, but a run of it is at most
:data:`WHITESPACE_RUN` characters (unbounded runs let a model loop on whitespace until
``max_tokens``, the failure vLLM users know); ``disable_any_whitespace`` makes it compact.
"""

from __future__ import annotations

import json
import re

from moeinfra.server.protocol import APIError

#: The longest run of whitespace JSON output may hold between two tokens.
WHITESPACE_RUN = 16
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def json_grammar(schema, param: str, compact: bool = False, whitespace: str | None = None) -> str:
    """The grammar of JSON following ``schema`` (a dict or its text)."""
    import llguidance

    options = {"whitespace_flexible": not compact}
    if not compact:
        options["whitespace_pattern"] = whitespace or rf"[ \t\n\r]{{0,{WHITESPACE_RUN}}}"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as err:
        raise APIError(400, f"{param}: the JSON schema cannot be read ({err})", param) from None
    return _checked(grammar, param)


def _checked(grammar: str, param: str) -> str:
    from moeinfra.engine.structured import grammar_error

    error = grammar_error(grammar)
    if error:
        raise APIError(400, f"{param}: {error}", param)
    return grammar


def _from_text_grammar(text: str, param: str) -> str:
    import llguidance

    if not isinstance(text, str) or not text.strip():
        raise APIError(400, f"{param} must be a non-empty grammar", param)
    try:
        lark = llguidance.gbnf_to_lark(text)
    except Exception:  # not GBNF: read as Lark
        lark = text
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param)


def _from_regex(pattern: str, param: str) -> str:
    import llguidance

    if not isinstance(pattern, str) or not pattern:
        raise APIError(400, f"{param} must be a non-empty regular expression", param)
    return _checked(llguidance.LLMatcher.grammar_from_regex(pattern), param)


def _constraint(spec: dict, param: str) -> str:
    """The grammar of a ``structured_outputs``-shaped dict."""
    given = [k for k in _KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(_KINDS) - {"disable_any_whitespace", "whitespace_pattern",
                                                "disable_fallback"})  # fmt: skip
    if unknown:
        raise APIError(400, f"{param}.{unknown[0]} is not supported", param)
    if len(given) != 1:
        raise APIError(
            400,
            f"{param} needs exactly one of {', '.join(_KINDS)} (got {', '.join(given) or 'none'})",
            param,
        )
    kind, value = given[0], spec[given[0]]
    compact = bool(spec.get("disable_any_whitespace"))
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as err:
            raise APIError(400, f"{param}: the JSON schema is not JSON ({err})", param) from None
        return json_grammar(schema, param, compact, spec.get("whitespace_pattern"))
    if kind == "json_object":
        return json_grammar({"type": "object"}, param, compact, spec.get("whitespace_pattern"))
    if kind == "regex":
        return _from_regex(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{param}.choice must be a non-empty list of strings", param)
        return _from_regex("|".join(re.escape(c) for c in value), param)
    return _from_text_grammar(value, param)


def grammar_of(body) -> str | None:
    """The request's grammar, or None when its output is free."""
    found = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema") or {}
            schema = spec.get("schema", spec.get("json_schema"))
            if not isinstance(schema, dict | str):
                raise APIError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema",
                    "response_format",
                )
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(
                400,
                f"response_format.type={kind!r} is not supported; use text, json_object or "
                "json_schema",
                "response_format",
            )
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise APIError(400, "structured_outputs must be an object", "structured_outputs")
        found.append(("structured_outputs", body.structured_outputs))
    legacy = {
        "json": body.guided_json,
        "regex": body.guided_regex,
        "choice": body.guided_choice,
        "grammar": body.guided_grammar,
    }
    for kind, value in legacy.items():
        if value is not None:
            spec = {kind: value}
            if body.guided_whitespace_pattern is not None:
                spec["whitespace_pattern"] = body.guided_whitespace_pattern
            found.append((f"guided_{kind}", spec))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[1][0]}: only one output constraint may be given ({found[0][0]} is too)",
            found[1][0],
        )
    return _constraint(found[0][1], found[0][0]) if found else None
