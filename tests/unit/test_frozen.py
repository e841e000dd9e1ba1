"""ledger.frozen: ``replacer`` gives what dataclasses.replace gives and ``quick_init`` builds
what the dataclass's own ``__init__`` builds, for the classes they accept, and both refuse the
ones they do not."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.effects import Effect, EffectKind, replace_effect
from ledger.frozen import quick_init, replacer
from ledger.states import EffectState

FIELDS = [f.name for f in dataclasses.fields(Effect)]


def _effect(**overrides: Any) -> Effect:
    values: dict[str, Any] = {name: f"v-{name}" for name in FIELDS}
    values.update(kind=EffectKind.OPERATION, state=EffectState.PENDING, fence=1, ordinal=0)
    values.update(overrides)
    return Effect(**values)


@given(
    changes=st.dictionaries(
        st.sampled_from(FIELDS),
        st.one_of(st.none(), st.integers(), st.text(max_size=5), st.sampled_from(EffectState)),
    )
)
def test_it_gives_what_dataclasses_replace_gives(changes: dict[str, Any]) -> None:
    before = _effect()
    original = dataclasses.astuple(before)
    fast, reference = replace_effect(before, **changes), dataclasses.replace(before, **changes)
    assert type(fast) is Effect
    assert dataclasses.astuple(fast) == dataclasses.astuple(reference)
    assert fast == reference and hash(fast) == hash(reference)
    assert dataclasses.astuple(before) == original  # the record it came from is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.state = EffectState.FAILED  # type: ignore[misc]


def test_a_keyword_that_is_not_a_field_is_refused() -> None:
    with pytest.raises(TypeError, match="no field"):
        replace_effect(_effect(), stat=EffectState.CONFIRMED)


@dataclass(frozen=True)
class _NoSlots:
    a: int


@dataclass(slots=True)
class _NotFrozen:
    a: int


@dataclass(frozen=True, slots=True)
class _PostInit:
    a: int

    def __post_init__(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _NotInInit:
    a: int
    b: int = dataclasses.field(init=False, default=0)


@dataclass(frozen=True, slots=True)
class _Derived(Effect):
    extra: int = 0


def test_fields_of_a_slotted_base_class_are_copied_too() -> None:
    before = _Derived(**{name: getattr(_effect(), name) for name in FIELDS}, extra=1)
    after = replacer(_Derived)(before, extra=2, fence=5)
    assert after == dataclasses.replace(before, extra=2, fence=5)


@pytest.mark.parametrize("cls", [_NoSlots, _NotFrozen, _PostInit, _NotInInit, int])
def test_a_class_it_would_copy_wrongly_is_refused(cls: type) -> None:
    with pytest.raises(TypeError):
        replacer(cls)


@pytest.mark.parametrize("cls", [_NoSlots, _NotFrozen, _PostInit, _NotInInit, int])
def test_quick_init_refuses_what_replacer_refuses(cls: type) -> None:
    with pytest.raises(TypeError):
        quick_init(cls)


def test_quick_init_refuses_keyword_only_fields() -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    with pytest.raises(TypeError, match="keyword-only"):
        quick_init(KeywordOnly)


def test_quick_init_refuses_a_field_named_like_its_own_names() -> None:
    @dataclass(frozen=True, slots=True)
    class Clashing:
        a: int
        _qi_set_a: int

    with pytest.raises(TypeError, match="named like"):
        quick_init(Clashing)


def test_fields_named_like_the_setters_of_replacer_are_set_right() -> None:
    @quick_init
    @dataclass(frozen=True, slots=True)
    class Awkward:
        set_a: int
        a: int
        default_a: int = 5

    built = Awkward(1, 2)
    assert (built.set_a, built.a, built.default_a) == (1, 2, 5)


def _shaped() -> type:
    """A fresh class with a required field, a default, a default factory and a field whose
    default is a shared object (dataclasses keeps it shared, so must quick_init)."""

    @dataclass(frozen=True, slots=True)
    class Shaped:
        a: int
        b: str | None
        c: int = 3
        d: list[int] = dataclasses.field(default_factory=list)
        e: tuple[int, ...] = (1, 2)

    return Shaped


Reference = _shaped()
Quick = quick_init(_shaped())


@given(
    a=st.integers(),
    b=st.one_of(st.none(), st.text(max_size=4)),
    rest=st.dictionaries(
        st.sampled_from(["c", "d", "e"]), st.one_of(st.integers(), st.lists(st.integers()))
    ),
    positional=st.booleans(),
)
def test_quick_init_builds_what_the_dataclass_builds(
    a: int, b: str | None, rest: dict[str, Any], positional: bool
) -> None:
    args: tuple[Any, ...] = (a, b) if positional else ()
    kwargs = dict(rest) if positional else {"a": a, "b": b, **rest}
    fast, reference = Quick(*args, **kwargs), Reference(*args, **kwargs)
    assert dataclasses.astuple(fast) == dataclasses.astuple(reference)
    assert repr(fast) == repr(reference)  # both classes are named _shaped.<locals>.Shaped
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 1


def test_quick_init_calls_the_factory_per_instance_and_keeps_plain_defaults_shared() -> None:
    one, two = Quick(1, None), Quick(2, None)
    assert one.d == [] and one.d is not two.d
    assert one.e is two.e is Reference(1, None).e


def test_quick_init_refuses_what_the_dataclass_refuses() -> None:
    with pytest.raises(TypeError):
        Quick(1)  # b is required
    with pytest.raises(TypeError):
        Quick(1, None, f=2)  # no such field
    with pytest.raises(TypeError):
        Quick(1, None, a=2)  # a given twice


def test_quick_init_sets_fields_of_a_slotted_base_class() -> None:
    values = {name: getattr(_effect(), name) for name in FIELDS}
    fast = quick_init(_shaped_derived())(**values, extra=4)
    assert dataclasses.astuple(fast) == dataclasses.astuple(_Derived(**values, extra=4))


def _shaped_derived() -> type:
    @dataclass(frozen=True, slots=True)
    class Derived(Effect):
        extra: int = 0

    return Derived
