"""Putting a JSON value's object keys in the order its JSON Schema declares them."""

from __future__ import annotations


def in_schema_order(value, schema, root=None):
    """`value` with object keys in the order the schema declares them.

    llguidance, like OpenAI's structured outputs, emits properties in schema
    order; reordering keys does not change what a JSON value means, so each
    instance is fed in that order ($ref and the combinators are followed to
    find the declared names; undeclared keys go last)."""
    root = schema if root is None else root
    if isinstance(value, dict):
        order = list(dict.fromkeys(_declared(schema, root, set())))
        keys = [k for k in order if k in value] + [k for k in value if k not in order]
        return {k: in_schema_order(value[k], _property(schema, root, k), root) for k in keys}
    if isinstance(value, list):
        return [in_schema_order(v, _items(schema, root), root) for v in value]
    return value


def _resolve(s, root):
    while isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
        target = root
        for part in s["$ref"][1:].split("/")[1:]:
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
        s = target
    return s if isinstance(s, dict) else {}


def _parts(s):
    return [sub for k in ("allOf", "anyOf", "oneOf") for sub in s.get(k, [])]


def _declared(schema, root, seen):
    s = _resolve(schema, root)
    if id(s) in seen:
        return []
    seen.add(id(s))
    return ([n for sub in _parts(s) for n in _declared(sub, root, seen)]
            + list(s.get("properties", {})))


def _property(schema, root, key):
    s = _resolve(schema, root)
    parts = [_property(sub, root, key) for sub in _parts(s)]
    if key in s.get("properties", {}):
        parts.append(s["properties"][key])
    elif isinstance(s.get("additionalProperties"), dict):
        parts.append(s["additionalProperties"])
    return {"allOf": parts}


def _items(schema, root):
    s = _resolve(schema, root)
    parts = [_items(sub, root) for sub in _parts(s)]
    if isinstance(s.get("items"), dict):
        parts.append(s["items"])
    return {"allOf": parts}
