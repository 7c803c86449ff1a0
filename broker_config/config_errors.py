"""Config validation errors that name the field's real path and the bad value."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import msgspec


def error_path(exc: Exception) -> str | None:
    """The field msgspec's message names (`... - at `$.a.b`` -> "a.b"), if it names one."""
    match = re.search(r" - at `\$\.(.*)`$", str(exc))
    return match.group(1) if match else None


def describe_validation_error(source: str, document: Any, exc: Exception, root: type) -> str:
    """Turn msgspec's `... - at `$.a[...].b`` into the field's real path and value."""
    message = str(exc)
    match = re.search(r" - at `\$(.*)`$", message)
    if not match:
        return f"{source}: {message}"
    reason = message[: match.start()]
    value: Any = document
    hint: Any = root
    names: list[str] = []
    for key, index, _any_key in re.findall(
        r"\.([A-Za-z0-9_-]+)|\[(\d+)\]|\[(\.\.\.)\]", match.group(1)
    ):
        hint = _unwrap(hint)
        if key:
            names.append(key)
            hint = typing.get_type_hints(hint).get(key, Any) if _is_struct(hint) else Any
            value = value.get(key) if isinstance(value, dict) else None
        elif index:
            names[-1] += f"[{index}]"
            hint = typing.get_args(hint)[0] if typing.get_args(hint) else Any
            value = value[int(index)] if isinstance(value, list) else None
        else:  # a dict entry: msgspec does not say which key, so find the failing one
            hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
            bad_key = _first_invalid_key(value, hint)
            names.append(bad_key or "?")
            value = value.get(bad_key) if isinstance(value, dict) else None
        if value is None:
            break
    shown = "" if value is None or isinstance(value, dict) else f" (value: {value!r})"
    return f"{source}: field `{'.'.join(names)}`: {reason}{shown}"


def _unwrap(hint: Any) -> Any:
    """Annotated[X, ...] -> X, X | None -> X."""
    while True:
        if typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        elif typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        else:
            return hint


def _is_struct(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def _first_invalid_key(mapping: Any, value_type: Any) -> str | None:
    if not isinstance(mapping, dict):
        return None
    for key, item in mapping.items():
        try:
            msgspec.convert(item, type=value_type)
        except (msgspec.ValidationError, ValueError):
            return str(key)
    return None
