"""For a test module that is PostgreSQL's alone (pools, pings, the server's connection limit):
importing :func:`postgres_backend` into it overrides the suite's parametrized ``backend``
fixture there, so every test of the module runs once, on PostgreSQL, and skips (or fails under
``AGENT_TXN_REQUIRE_PG=1``) when no server is reachable."""

from __future__ import annotations

import pytest


@pytest.fixture(name="backend")
def postgres_backend() -> str:
    """``"postgres"``, once PostgreSQL is known to be reachable."""
    from tests.conftest import require_pg

    require_pg()
    return "postgres"
