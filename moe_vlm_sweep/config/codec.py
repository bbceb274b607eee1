"""Dataclass <-> plain data, for every file a run leaves behind: ``plan.json`` (and the RunConfig in it),
``metrics.json``, ``failure.json`` and ``result.json``.

One codec, driven by the dataclasses' own type hints, so a file is read into the same typed object that wrote
it: nested dataclasses, ``X | None``, ``list[X]``, ``dict[str, X]`` and Enums (a ``StrEnum`` is written as its
string). A missing required field, an unknown key or a value of the wrong kind is an error naming the field's
dotted path, never a ``KeyError`` deep inside a consumer. Imports nothing beyond the standard library: the
worker and the sweep both use it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any


class DecodeError(ValueError):
    """Plain data that does not fit the dataclass it is read into."""


_LEAVES: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}
"""Leaf types checked on read; a float field takes a JSON integer (``600`` for ``600.0``)."""


def to_dict(obj: Any) -> dict[str, Any]:
    """The dataclass as JSON-ready plain data (Enums stay ``str`` subclasses, which ``json`` writes as strings)."""
    return dataclasses.asdict(obj)


def from_dict[T](cls: type[T], data: Any, *, error: type[Exception] = DecodeError, where: str = "") -> T:
    """Rebuild ``cls`` (a dataclass) from plain data, running every ``__post_init__`` again.

    Fields absent from ``data`` take their defaults; a missing field without one, an unknown key or a value of
    the wrong kind raises ``error`` (``DecodeError`` unless the caller has its own, as the config does) with
    the dotted path of the field, prefixed by ``where`` (e.g. the file)."""
    return _decode(cls, data, f"{where}: " if where else "", "", error)


def _decode(hint: Any, value: Any, where: str, path: str, error: type[Exception]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, value, where, path, error)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _decode(options[0], value, where, path, error)
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in hint)
            raise error(f"{where}{path}={value!r} must be one of {allowed}") from None
    if origin in (list, tuple) and args:
        _expect(value, (list, tuple), where, path, error)
        return [_decode(args[0], v, where, f"{path}[{i}]", error) for i, v in enumerate(value)]
    if origin is dict and args:
        _expect(value, (Mapping,), where, path, error)
        return {k: _decode(args[1], v, where, f"{path}.{k}", error) for k, v in value.items()}
    if hint in _LEAVES:
        _expect(value, _LEAVES[hint], where, path, error)
        if hint is not bool and isinstance(value, bool):
            raise error(f"{where}{path}={value!r} must be {hint.__name__}, not bool")
    return value


def _expect(value: Any, kinds: tuple[type, ...], where: str, path: str, error: type[Exception]) -> None:
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise error(f"{where}{path}={value!r} must be {names}, not {type(value).__name__}")


def _decode_dataclass(cls: type, data: Any, where: str, path: str, error: type[Exception]) -> Any:
    _expect(data, (Mapping,), where, path or cls.__name__, error)
    prefix = f"{path}." if path else ""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{where}unknown key(s) for {cls.__name__}: {', '.join(prefix + k for k in unknown)}")
    missing = [
        prefix + name
        for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise error(f"{where}{cls.__name__} is missing required field(s): {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _decode(hints[name], data[name], where, prefix + name, error) for name in fields if name in data}
    return cls(**kwargs)
