"""Time-ordered row ids (``ledger.ids``): UUIDv7's layout, the minting millisecond first."""

from __future__ import annotations

import time
import uuid

import pytest

from ledger import ids
from orchestrator import keys


def test_an_id_is_a_uuid7_in_32_lowercase_hex_digits() -> None:
    before = time.time_ns() // 1_000_000
    minted = ids.time_ordered_id()
    after = time.time_ns() // 1_000_000
    parsed = uuid.UUID(hex=minted)
    assert minted == parsed.hex  # 32 lowercase hex digits, like uuid4().hex
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert before <= parsed.int >> 80 <= after  # the first 48 bits are the Unix milliseconds
    assert keys.is_identifier(minted)


def test_ids_sort_by_the_millisecond_they_were_minted(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(1_700_000_000_000, 1_700_000_000_000 + 2_000))
    monkeypatch.setattr(ids.time, "time_ns", lambda: next(clock) * 1_000_000)
    minted = [ids.time_ordered_id() for _ in range(2_000)]  # one per millisecond
    assert minted == sorted(minted)
    assert [uuid.UUID(hex=m).int >> 80 for m in minted[:3]] == [
        1_700_000_000_000,
        1_700_000_000_001,
        1_700_000_000_002,
    ]


def test_ids_of_one_millisecond_differ_in_their_74_random_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ids.time, "time_ns", lambda: 1_700_000_000_000 * 1_000_000)
    minted = {ids.time_ordered_id() for _ in range(10_000)}
    assert len(minted) == 10_000
