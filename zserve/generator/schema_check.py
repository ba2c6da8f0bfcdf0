"""What the grammar compiler cannot enforce in a JSON schema, found before it compiles: a pure walk over the
schema, used by the frontends (at decode time, naming ``response_format`` or ``tools``) and by the engine
(direct clients), so a schema is either enforced or refused, never accepted with a logged warning.

xgrammar 0.2.9 converts these silently or with only a log line (checked by comparing the grammar it builds
with and without each keyword): a ``$ref`` to anything but this document (it fetches nothing), ``allOf``
with more than one schema ("support ... is still ongoing"), ``not``, ``uniqueItems: true``, ``contains``
(and ``minContains``/``maxContains``), ``propertyNames``, ``dependentRequired``, ``dependentSchemas`` and
``dependencies``. An unsatisfiable schema it can see (``minLength`` above ``maxLength``, an empty ``enum``)
it refuses itself when compiling, which the engine answers the same way. No heavy imports: the frontends
import this module."""

from __future__ import annotations

from typing import Any

# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
        "if", "then", "else")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_NOT_ENFORCED = ("not", "contains", "minContains", "maxContains", "propertyNames", "dependentRequired",
                 "dependentSchemas", "dependencies")  # fmt: skip
_MAX_DEPTH = 64


def unenforceable(schema: Any) -> str | None:
    """Why the grammar could not enforce ``schema`` (a decoded JSON schema), or None if it can."""
    return _walk(schema, "$", 0)


def _walk(schema: Any, where: str, depth: int) -> str | None:
    if not isinstance(schema, dict):
        return None  # true/false and malformed values: the compiler takes or refuses them
    if depth > _MAX_DEPTH:
        return f"{where}: nested deeper than {_MAX_DEPTH} schemas"
    for key in _NOT_ENFORCED:
        if key in schema:
            return f"{where}.{key}: `{key}` cannot be enforced by the grammar"
    if schema.get("uniqueItems") is True:
        return f"{where}.uniqueItems: `uniqueItems: true` cannot be enforced by the grammar"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{where}.$ref: {ref!r} is not in this schema (remote references are not fetched)"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{where}.allOf: an allOf of {len(all_of)} schemas cannot be enforced (one schema only)"
    for key in _ONE:
        found = _walk(schema.get(key), f"{where}.{key}", depth + 1)
        if found:
            return found
    for key in _MANY:
        value = schema.get(key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                found = _walk(item, f"{where}.{key}[{i}]", depth + 1)
                if found:
                    return found
    for key in _NAMED:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, item in value.items():
                found = _walk(item, f"{where}.{key}.{name}", depth + 1)
                if found:
                    return found
    return None
