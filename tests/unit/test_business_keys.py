"""Stored business keys (:func:`orchestrator.keys.tenant_business_key`): the tenant first, and
two different (tenant, key) pairs never share a stored key, whatever the tenant's characters."""

from __future__ import annotations

import pytest

from ledger.schema import BUSINESS_KEY_LENGTH, STORED_BUSINESS_KEY_LENGTH, TENANT_LENGTH
from orchestrator.keys import (
    rendered_business_key,
    tenant_business_key,
)


def test_the_tenant_comes_first() -> None:
    assert tenant_business_key("default", "order:42") == "default/order:42"


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("a/b", "c"), ("a", "b/c")),
        (("a%2Fb", "c"), ("a/b", "c")),
        (("a%", "2F/c"), ("a%2F", "c")),
        (("default", "x"), ("other", "x")),
    ],
)
def test_different_pairs_never_share_a_stored_key(
    one: tuple[str, str], other: tuple[str, str]
) -> None:
    assert tenant_business_key(*one) != tenant_business_key(*other)


def test_the_longest_stored_key_fits_its_column() -> None:
    longest = tenant_business_key("/" * TENANT_LENGTH, "k" * BUSINESS_KEY_LENGTH)
    assert len(longest) == STORED_BUSINESS_KEY_LENGTH


@pytest.mark.parametrize(
    ("tenant", "key"), [("default", "order:42"), ("a/b%", "c/d"), ("t", "/"), ("t", "x/y/z")]
)
def test_the_caller_gets_back_the_key_it_rendered(tenant: str, key: str) -> None:
    assert rendered_business_key(tenant_business_key(tenant, key)) == key
