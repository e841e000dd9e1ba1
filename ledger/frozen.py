"""``dataclasses.replace`` and ``__init__`` for the frozen, slotted records the hot path
builds, at a fraction of the cost.

Why: a saga's driver keeps its effects as frozen :class:`~ledger.effects.Effect` records and
rebuilds one on every recorded outcome (about five per saga); ``dataclasses.replace`` on its 22
fields took 5.1 µs — it walks the fields, builds a keyword dict and calls the frozen
``__init__``, which sets each field through ``object.__setattr__`` by name — about 3 % of a
saga's client CPU on SQLite (``docs/benchmarks-log.md``, item 37). The function built here copies
each slot straight across, with only the changed ones taken from the keywords. It gives what
``dataclasses.replace`` gives for the classes it accepts: frozen, slotted dataclasses whose
fields are all set by ``__init__`` and that have no ``__post_init__`` (checked once, when the
function is built), and it refuses a keyword that is not a field with ``TypeError``, as
``dataclasses.replace`` does.

:func:`quick_init` does the same for construction. A frozen dataclass's generated ``__init__``
sets each field as ``object.__setattr__(self, 'name', value)`` — a global lookup, an attribute
lookup and a by-name search of the class's MRO per field — because its own ``__setattr__``
refuses. A saga builds about fifteen such records (its effects, claims, decisions: some 165
fields in all), and the dataclasses' generated ``__init__`` methods were 2.5 % of the bench's
samples of their own, next after SQLite's statements and commits and the JSON encoder
(``docs/benchmarks-log.md``, item 57).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _fields(cls: type[Any]) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of a frozen, slotted dataclass whose fields are all set by ``__init__`` and
    that has no ``__post_init__``; ``TypeError`` for any other class."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen, slotted dataclass")
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__} sets fields outside __init__")
    return fields


def _slot_setters(cls: type[Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``set_<name>``: each field's slot descriptor's ``__set__`` (a field may live in a
    slotted base class's slots)."""
    setters: dict[str, Any] = {}
    for n in names:
        slot = next((k.__dict__[n] for k in cls.__mro__ if n in k.__dict__), None)
        if not isinstance(slot, types.MemberDescriptorType):
            raise TypeError(f"{cls.__name__}.{n} is not a slot")
        setters[f"set_{n}"] = slot.__set__
    return setters


def replacer(cls: type[T]) -> Callable[..., T]:
    """A function ``(obj, **changes) -> T`` equal to ``dataclasses.replace`` for ``cls``."""
    names = tuple(f.name for f in _fields(cls))
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
        **_slot_setters(cls, names),
    }
    exec("\n".join(lines), scope)
    replace: Callable[..., T] = scope["replace"]
    replace.__qualname__ = replace.__name__ = f"replace_{cls.__name__}"
    return replace


C = TypeVar("C", bound=type[Any])


def quick_init(cls: C) -> C:
    """Class decorator (above ``@dataclass(frozen=True, slots=True)``): replace the class's
    ``__init__`` with one that takes the same arguments — the same names, order, defaults and
    default factories — and sets each slot through its own descriptor.

    It accepts what :func:`replacer` accepts, and refuses keyword-only fields (the generated
    signature has none) and fields whose names the generated function uses itself (``self``
    and names starting ``_qi_``). The instances it builds are the ones the dataclass's own
    ``__init__`` builds: equal, hashed alike, still frozen."""
    fields = _fields(cls)
    if any(f.kw_only is True for f in fields):
        raise TypeError(f"{cls.__name__} has keyword-only fields")
    if any(f.name == "self" or f.name.startswith("_qi_") for f in fields):
        raise TypeError(f"{cls.__name__} has a field named like the generated __init__'s own")
    names = tuple(f.name for f in fields)
    # The parameters are the fields' names, so everything else the function refers to is
    # named ``_qi_…``, which no parameter can shadow.
    scope: dict[str, Any] = {"_qi_HAS_FACTORY": _HAS_FACTORY}
    scope.update({f"_qi_{k}": v for k, v in _slot_setters(cls, names).items()})
    params, body = ["self"], []
    for f in fields:
        value = f.name
        if f.default is not dataclasses.MISSING:
            scope[f"_qi_default_{f.name}"] = f.default
            params.append(f"{f.name}=_qi_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_qi_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_qi_HAS_FACTORY")
            value = f"_qi_factory_{f.name}() if {f.name} is _qi_HAS_FACTORY else {f.name}"
        else:
            params.append(f.name)
        body.append(f"    _qi_set_{f.name}(self, {value})")
    exec(f"def __init__({', '.join(params)}):\n" + "\n".join(body or ["    pass"]), scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls


class _HasFactory:
    """The default of a field with a default factory, as ``dataclasses`` marks it."""

    def __repr__(self) -> str:
        return "<factory>"


_HAS_FACTORY = _HasFactory()
