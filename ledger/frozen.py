"""``dataclasses.replace`` for the frozen, slotted records the hot path rebuilds, at a third of
the cost.

Why: a saga's driver keeps its effects as frozen :class:`~ledger.effects.Effect` records and
rebuilds one on every recorded outcome (about five per saga); ``dataclasses.replace`` on its 22
fields took 5.1 µs — it walks the fields, builds a keyword dict and calls the frozen
``__init__``, which sets each field through ``object.__setattr__`` by name — about 3 % of a
saga's client CPU on SQLite (``docs/benchmarks.md``, item 37). The function built here copies
each slot straight across, with only the changed ones taken from the keywords. It gives what
``dataclasses.replace`` gives for the classes it accepts: frozen, slotted dataclasses whose
fields are all set by ``__init__`` and that have no ``__post_init__`` (checked once, when the
function is built), and it refuses a keyword that is not a field with ``TypeError``, as
``dataclasses.replace`` does.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def replacer(cls: type[T]) -> Callable[..., T]:
    """A function ``(obj, **changes) -> T`` equal to ``dataclasses.replace`` for ``cls``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen, slotted dataclass")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__} sets fields outside __init__")
    names = tuple(f.name for f in fields)
    lines = [
        "def replace(obj, /, **changes):",
        "    if not changes.keys() <= names:",
        "        unknown = sorted(set(changes) - set(names))",
        "        raise TypeError(f'{cls.__name__} has no field(s) {unknown}')",
        "    new = new_instance(cls)",
    ]
    # Each slot's own descriptor sets it: no lookup of the attribute by name, and no frozen
    # ``__setattr__`` to bypass.
    lines += [f"    set_{n}(new, changes[{n!r}] if {n!r} in changes else obj.{n})" for n in names]
    lines.append("    return new")
    scope: dict[str, Any] = {
        "names": frozenset(names),
        "cls": cls,
        "new_instance": object.__new__,
    }
    for n in names:  # a field may live in a slotted base class's slots
        slot = next((k.__dict__[n] for k in cls.__mro__ if n in k.__dict__), None)
        if not isinstance(slot, types.MemberDescriptorType):
            raise TypeError(f"{cls.__name__}.{n} is not a slot")
        scope[f"set_{n}"] = slot.__set__
    exec("\n".join(lines), scope)
    replace: Callable[..., T] = scope["replace"]
    replace.__qualname__ = replace.__name__ = f"replace_{cls.__name__}"
    return replace
