"""ledger.frozen.replacer: what dataclasses.replace gives, for the classes it accepts, and a
refusal for the ones it does not."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.effects import Effect, EffectKind, replace_effect
from ledger.frozen import replacer
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
