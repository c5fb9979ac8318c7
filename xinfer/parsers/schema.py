"""A small JSON-schema check for tool-call arguments (the subset tool schemas use)."""
from __future__ import annotations

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    # bool is an int subclass in Python, but not an integer in JSON
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _type_name(v) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _TYPES[name](v):
            return name
    return type(v).__name__


def _check(value, schema, path: str) -> str | None:
    if not isinstance(schema, dict) or not schema:
        return None
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and all(_check(value, s, path) is not None for s in options):
            return f"{path}: matches none of {key}"
    t = schema.get("type")
    if t is not None:
        allowed = t if isinstance(t, list) else [t]
        known = [a for a in allowed if a in _TYPES]
        if known and not any(_TYPES[a](value) for a in known):
            return f"{path}: expected {' or '.join(known)}, got {_type_name(value)}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']!r}"
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for name in schema.get("required") or []:
            if name not in value:
                return f"{path}: missing required property {name!r}"
        extra = schema.get("additionalProperties", True)
        for name, v in value.items():
            if name in props:
                reason = _check(v, props[name], f"{path}.{name}")
            elif extra is False:
                reason = f"{path}: unexpected property {name!r}"
            elif isinstance(extra, dict):
                reason = _check(v, extra, f"{path}.{name}")
            else:
                reason = None
            if reason:
                return reason
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            reason = _check(v, schema["items"], f"{path}[{i}]")
            if reason:
                return reason
    return None


def check_arguments(arguments: dict, schema: dict | None) -> str | None:
    """None when `arguments` matches `schema` (a tool's `function.parameters`), else why not."""
    if schema is None:
        return None
    return _check(arguments, schema, "arguments")
