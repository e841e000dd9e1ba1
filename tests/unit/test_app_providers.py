"""``--app module:attribute`` (``worker``, ``serve``, ``mcp``): what loads, and what is refused
in one line instead of a traceback from the caller's attribute or from the provider registry."""

from __future__ import annotations

import pytest

from orchestrator.errors import DefinitionInvalid
from orchestrator.workerproc import load_providers
from providers.contract import Provider
from providers.memory import MemoryShop

#: Read by the tests below as ``--app`` reads them: ``module:attribute``.
SHOP = MemoryShop()
LISTED = SHOP.providers()


def build() -> list[Provider]:
    return list(LISTED)


def build_wants_an_argument(region: str) -> list[Provider]:
    return list(LISTED)


def build_fails() -> list[Provider]:
    raise RuntimeError("no credentials in the environment")


@pytest.mark.parametrize(
    ("attribute", "closes"), [("LISTED", False), ("build", False), ("SHOP", True)]
)
async def test_a_list_a_factory_or_an_app_of_providers_loads(attribute: str, closes: bool) -> None:
    providers, closer = await load_providers(f"{__name__}:{attribute}")
    assert providers == LISTED and len(providers) == 3
    assert closer is (SHOP if closes else None)


@pytest.mark.parametrize(
    ("app_ref", "reason"),
    [
        # Each ended in a traceback: from calling the attribute, or from the registry later.
        ("json:dumps", "loading providers from json:dumps failed: TypeError: "),
        (f"{__name__}:build_wants_an_argument", "failed: TypeError: "),
        (f"{__name__}:build_fails", "failed: RuntimeError: no credentials in the environment"),
        ("os:sep", "os:sep gives no providers (it gave nothing)"),
        ("os:environ", "os:environ gives no providers (it gave nothing)"),
        ("sys:path", "sys:path gives no providers (it gave str "),
        ("nosuch_module_here:x", "cannot load nosuch_module_here:x"),
    ],
)
async def test_what_gives_no_providers_is_refused_with_its_reason(
    app_ref: str, reason: str
) -> None:
    with pytest.raises(DefinitionInvalid) as refused:
        await load_providers(app_ref)
    assert reason in refused.value.details["reason"]
