"""Schema checks of decoded control messages: every field's type, and the ranges that hold for
every message (pure: no sockets).

A peer's frame becomes a message only if each field has its annotated type (``bool`` is not an
``int``, an ``int`` stands for a ``float``, ``X | None``, ``tuple[X, ...]``, fixed tuples,
``NamedTuple`` rows, ``dict[str, Any]``, a nested record such as ``SamplingParams``: a map of
its own fields only, a ``StrEnum`` such as ``Role``: one of its values, built as the member)
and every number in it is finite and not negative — ids, counts, token ids, addresses, sizes,
seconds and sampling settings all are — but a ``seed``, which may be any integer. Ranges
particular to one message (a role, a name) are its own ``__post_init__``'s, and a record's its
own (``SamplingParams`` refuses ``top_p`` 0). ``check_fields`` raises ``ValueError`` naming the
field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from enum import StrEnum
from typing import Any, Union

from dualpath.errors import DualPathError

SIGNED_FIELDS = frozenset({"seed"})  # integers that may be negative
MAX_DEPTH = 4  # nested tuples deeper than any message has are refused


def check_fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each nested record's map built as its dataclass; ``ValueError`` unless
    every value fits ``cls``'s annotation of its field."""
    hints = _hints(cls)
    checked = {}
    for name, value in values.items():
        _check(value, hints[name], name, signed=name in SIGNED_FIELDS, depth=0)
        checked[name] = _build(value, hints[name], name)
    return checked


def _build(value: Any, hint: Any, name: str) -> Any:
    """A checked record map as its dataclass (the record's own checks run), a checked string as
    its enum member; others as given."""
    if _is_str_enum(hint):
        return hint(value)
    if not (_is_record(hint) and isinstance(value, dict)):
        return value
    try:
        return hint(**value)
    except (DualPathError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from exc


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(value: Any, hint: Any, name: str, signed: bool, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{name}: nested too deep")
    if hint is Any:
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return
        others = [a for a in args if a is not type(None)]
        if len(others) != 1:
            raise ValueError(f"{name}: unsupported annotation {hint}")
        _check(value, others[0], name, signed, depth)
        return
    if origin is tuple or _is_named_tuple(hint):
        _check_tuple(value, hint, name, signed, depth)
        return
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{name}: expected a map with string keys")
        return
    if _is_record(hint):
        _check_record(value, hint, name, depth)
        return
    _check_scalar(value, hint, name, signed)


def _check_record(value: Any, hint: type, name: str, depth: int) -> None:
    """A nested record on the wire: a map of some of ``hint``'s fields (the rest default),
    each fitting its annotation; an unknown key is refused."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name}: expected a map with string keys")
    hints = _hints(hint)
    for key, item in value.items():
        if key not in hints:
            raise ValueError(f"{name}: unknown field {key!r}")
        _check(item, hints[key], f"{name}.{key}", signed=key in SIGNED_FIELDS, depth=depth + 1)


def _check_tuple(value: Any, hint: Any, name: str, signed: bool, depth: int) -> None:
    if not isinstance(value, tuple):
        raise ValueError(f"{name}: expected an array, got {type(value).__name__}")
    if _is_named_tuple(hint):
        rows = list(_hints(hint).values())
        if len(value) != len(rows):
            raise ValueError(f"{name}: expected {len(rows)} entries, got {len(value)}")
        for item, row in zip(value, rows, strict=True):
            _check(item, row, name, signed, depth + 1)
        return
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis and args[0] is int and not signed:
        # token ids and req ids, up to millions a message: one pass in C, not one call each
        if value and (set(map(type, value)) != {int} or min(value) < 0):
            raise ValueError(f"{name}: expected integers >= 0")
        return
    if len(args) == 2 and args[1] is Ellipsis:
        for item in value:
            _check(item, args[0], name, signed, depth + 1)
        return
    if len(value) != len(args):
        raise ValueError(f"{name}: expected {len(args)} entries, got {len(value)}")
    for item, arg in zip(value, args, strict=True):
        _check(item, arg, name, signed, depth + 1)


def _check_scalar(value: Any, hint: Any, name: str, signed: bool) -> None:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and (signed or value >= 0)
    elif hint is float:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and value >= 0)
    elif hint in (str, bytes):
        ok = isinstance(value, hint)
    elif _is_str_enum(hint):
        ok = isinstance(value, str) and value in hint._value2member_map_
    else:
        raise ValueError(f"{name}: unsupported annotation {hint}")
    if not ok:
        raise ValueError(f"{name}: {value!r} is not a valid {getattr(hint, '__name__', hint)}")


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _is_str_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, StrEnum)


def _is_named_tuple(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")
