"""The provider registry: which providers steps may name, and their action contracts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from providers.contract import ActionContract, Provider, UnknownAction


class UnknownProvider(LookupError):
    """No provider of that name is registered."""


class DuplicateProvider(ValueError):
    """A provider of that name is already registered."""


class ProviderRegistry:
    """Providers by name. Registration happens at start-up; lookups are plain dict reads."""

    def __init__(self, providers: Iterable[Provider] = ()) -> None:
        self._providers: dict[str, Provider] = {}
        for provider in providers:
            self.register(provider)

    def register(self, provider: Provider, *, replace: bool = False) -> Provider:
        """Add ``provider`` under its name; a second one of that name needs ``replace=True``."""
        if not isinstance(provider, Provider):
            raise TypeError(f"{provider!r} does not implement the Provider protocol")
        name = provider.name
        if name in self._providers and not replace:
            raise DuplicateProvider(f"a provider named {name!r} is already registered")
        self._providers[name] = provider
        return provider

    def get(self, name: str) -> Provider:
        """The provider called ``name``; raises :class:`UnknownProvider` if none is."""
        try:
            return self._providers[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownProvider(
                f"no provider named {name!r} is registered (registered: {known})"
            ) from None

    def contract(self, provider_name: str, action: str) -> ActionContract:
        """The contract of ``provider_name.action``; raises UnknownProvider or UnknownAction."""
        provider = self.get(provider_name)
        actions = provider.actions()
        if action not in actions:
            offered = ", ".join(sorted(actions)) or "none"
            raise UnknownAction(
                f"provider {provider_name!r} has no action {action!r} (it offers: {offered})"
            )
        return provider.contract(action)

    def names(self) -> list[str]:
        """Registered provider names, sorted."""
        return sorted(self._providers)

    def __contains__(self, name: object) -> bool:
        return name in self._providers

    def __iter__(self) -> Iterator[Provider]:
        return iter(list(self._providers.values()))

    def __len__(self) -> int:
        return len(self._providers)

    def __repr__(self) -> str:
        return f"ProviderRegistry({self.names()!r})"


__all__ = ["DuplicateProvider", "ProviderRegistry", "UnknownProvider"]
