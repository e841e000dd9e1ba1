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


class App:
    """An app that opened something for its providers (a pool, a client) and closes it."""

    def __init__(self, providers: list[object], *, fails: bool = False) -> None:
        self.given, self.fails, self.closed = providers, fails, False

    def providers(self) -> list[object]:
        if self.fails:
            raise RuntimeError("the provider registry refused a name")
        return self.given

    async def close(self) -> None:
        self.closed = True


OPENED: list[App] = []


def build_app_of_nothing() -> App:
    OPENED.append(App([]))
    return OPENED[-1]


def build_app_of_strangers() -> App:
    OPENED.append(App(["not a provider"]))
    return OPENED[-1]


def build_app_that_fails() -> App:
    OPENED.append(App(list(LISTED), fails=True))
    return OPENED[-1]


#: An app with a ``close``, which the caller is handed to close when it stops.
CLOSABLE = App(list(LISTED))


@pytest.mark.parametrize(
    ("attribute", "closes"),
    # The memory shop has providers() and no close: nothing to hand back.
    [("LISTED", False), ("build", False), ("SHOP", False), ("CLOSABLE", True)],
)
async def test_a_list_a_factory_or_an_app_of_providers_loads(attribute: str, closes: bool) -> None:
    providers, closer = await load_providers(f"{__name__}:{attribute}")
    assert providers == LISTED and len(providers) == 3
    assert closer is (CLOSABLE if closes else None)


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


@pytest.mark.parametrize(
    "factory", ["build_app_of_nothing", "build_app_of_strangers", "build_app_that_fails"]
)
async def test_an_app_that_is_refused_is_closed(factory: str) -> None:
    # The caller closes the app it is given; on a refusal it is given nothing, and what the
    # app had opened stayed open until the process ended.
    OPENED.clear()
    with pytest.raises(DefinitionInvalid):
        await load_providers(f"{__name__}:{factory}")
    assert [app.closed for app in OPENED] == [True]
