"""Example instances of every contract type, built from the type information alone.

Used by the round-trip tests, so a message added to the contract is covered
without anyone remembering to write an example for it.
"""

from __future__ import annotations

import enum
import itertools
import typing

import msgspec
import msgspec.inspect as mi

from llmgw import contracts as c

_counter = itertools.count(1)


def _value(t: mi.Type):
    n = next(_counter)
    match t:
        case mi.StrType():
            return f"s{n}"
        case mi.IntType():
            return n
        case mi.FloatType():
            return n + 0.5
        case mi.BoolType():
            return n % 2 == 0
        case mi.EnumType():
            members = list(t.cls)
            return members[n % len(members)]
        case mi.ListType():
            return [_value(t.item_type), _value(t.item_type)]
        case mi.DictType():
            return {_value(t.key_type): _value(t.value_type)}
        case mi.UnionType():
            non_none = [x for x in t.types if not isinstance(x, mi.NoneType)]
            return _value(non_none[0])
        case mi.StructType():
            return build(t.cls)
        case mi.NoneType():
            return None
    raise TypeError(f"no example for {t!r}")


def build(cls: type[msgspec.Struct]):
    """An instance with every field set to a non-default value."""
    info = mi.type_info(cls)
    kwargs = {}
    for f in info.fields:
        if f.name in ("v",):
            continue
        kwargs[f.name] = _value(f.type)
    return cls(**kwargs)


def all_examples() -> list[c.Message]:
    return [build(cls) for cls in c.ALL_MESSAGES]


__all__ = ["all_examples", "build", "enum", "typing"]
