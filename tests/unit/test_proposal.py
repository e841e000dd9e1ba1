"""Proposal leak test: for generated commands and inputs, the text the person confirms shows the
business values and never a token, digest or structural id (property-based)."""

from __future__ import annotations

import copy
import re
import secrets
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.definitions import normalize
from orchestrator.guidance import MAX_PROPOSAL_CHARS, proposal_text
from providers.memory import MemoryShop
from providers.registry import ProviderRegistry
from tests.support.commands import ORDER_COMMAND

REGISTRY = ProviderRegistry(MemoryShop().providers())
HEX_RUN = re.compile(r"[0-9a-f]{32,}")

# Business values: printable text without long hex runs of its own (so a hex run in the text can
# only have come from the server), plus UUID-looking strings, which ARE business data here.
business_text = st.text(
    alphabet=st.characters(categories=("L", "N", "Zs"), max_codepoint=0x9FFF),
    min_size=1,
    max_size=30,
).filter(lambda s: s.strip() and not HEX_RUN.search(s))
uuid_like = st.uuids().map(str)


def _command(extra_field: str, uses_tx: bool) -> dict[str, Any]:
    """The order command with a free-text input and, optionally, server-made payload values
    (only fields the shop's contracts declare may be used)."""
    data = copy.deepcopy(ORDER_COMMAND)
    data["inputs"]["note"] = {"type": "string", "max_length": 200}
    charge = data["steps"][1]["payload"]
    charge[extra_field] = {"$ref": "inputs.note"}
    if uses_tx:
        # A structural value (the transaction id) and a later-known one (an earlier step's id).
        data["steps"][0]["payload"]["for"] = {"$ref": "tx.id"}
        charge["order"] = {"$ref": "steps.reserve.remote_id"}
    return data


@settings(max_examples=60, deadline=None)
@given(
    order_id=st.one_of(business_text, uuid_like),
    note=business_text,
    amount=st.integers(min_value=1, max_value=10**9),
    field=st.sampled_from(["order_id"]),
    uses_tx=st.booleans(),
    language=st.sampled_from(["en", "zh-TW", "fr"]),
)
def test_proposal_shows_business_values_and_no_structure(
    order_id: str, note: str, amount: int, field: str, uses_tx: bool, language: str
) -> None:
    stored = normalize(_command(field, uses_tx), registry=REGISTRY)
    inputs = {"order_id": order_id, "sku": "sku-1", "amount": amount, "note": note}
    text = proposal_text(stored, inputs, language, needs_approval=False)
    assert len(text) <= MAX_PROPOSAL_CHARS
    token = secrets.token_hex(16)
    for structural in (stored.digest, token, "tx.id", "$ref", "forward"):
        assert structural not in text
    assert not HEX_RUN.search(text.replace(order_id, ""))  # no server-made hex ids
    assert str(amount) in text and "sku-1" in text
    if not uses_tx:  # otherwise the order field carries a later-known value, left out
        assert " ".join(order_id.split())[:79] in text  # shown, even when it looks like a UUID
    assert " ".join(note.split())[:79] in text


def test_the_proposal_is_in_the_rooms_language() -> None:
    stored = normalize(_command("order_id", False), registry=REGISTRY)
    inputs = {"order_id": "42", "sku": "sku-1", "amount": 5, "note": "x"}
    zh = proposal_text(stored, inputs, "zh-TW", needs_approval=True)
    en = proposal_text(stored, inputs, "en", needs_approval=True)
    assert zh.startswith("我準備執行") and "核准" in zh
    assert en.startswith("I am ready to run") and "approver" in en
