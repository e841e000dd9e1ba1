"""``agent-txn principals``: no success printed for what every request would refuse anyway.

A token for an unverified principal, or bound to a room the principal is not (or no longer) a
member of, was printed and then refused by every request; a deleted principal could be enabled,
verified, granted and joined, each printing success, and ``list`` showed it
``[verified,deleted]``. Both backends.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner, Result

from orchestrator import cli

if TYPE_CHECKING:
    from tests.conftest import DbUrls

SECRET = "local-test-secret-0123456789abcdef"


def run(db: str, *args: str) -> Result:
    env = {k: None for k in os.environ if k.startswith("AGENT_TXN_")}
    return CliRunner().invoke(cli.app, ["principals", *args, "--db", db], env=env)


def ok(db: str, *args: str) -> str:
    result = run(db, *args)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def refused(db: str, *args: str) -> str:
    """Exit 2, one ``error:`` line, no traceback; returns the line."""
    result = run(db, *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def db(db_urls: DbUrls) -> str:
    result = CliRunner().invoke(cli.app, ["db", "upgrade", "--db", db_urls.store])
    assert result.exit_code == 0, result.stderr
    return db_urls.store


def test_no_token_for_an_unverified_principal(db: str) -> None:
    ok(db, "add", "u1", "--kind", "user", "--name", "Ann", "--unverified")
    line = refused(db, "token", "u1", "--secret", SECRET)
    assert line == "error: principal 'u1' is unverified: its tokens would be refused"
    ok(db, "verify", "u1")
    assert ok(db, "token", "u1", "--secret", SECRET).count(".") == 2


def test_no_token_bound_to_a_room_the_principal_is_not_in(db: str) -> None:
    ok(db, "add", "u1", "--kind", "user", "--name", "Ann")
    expected = (
        "error: principal 'u1' is not a member of room 'r1': a token bound to it would be refused"
    )
    assert refused(db, "token", "u1", "--secret", SECRET, "--room", "r1") == expected
    ok(db, "join", "u1", "r1")
    assert ok(db, "token", "u1", "--secret", SECRET, "--room", "r1").count(".") == 2
    ok(db, "leave", "u1", "r1")  # a past membership is no membership
    assert refused(db, "token", "u1", "--secret", SECRET, "--room", "r1") == expected


@pytest.mark.parametrize(
    "change",
    [
        ["enable", "u1"],
        ["disable", "u1"],
        ["verify", "u1"],
        ["grant", "u1", "shop", "charge"],
        ["join", "u1", "r1"],
    ],
)
def test_a_deleted_principal_can_no_longer_be_changed(db: str, change: list[str]) -> None:
    ok(db, "add", "u1", "--kind", "user", "--name", "Ann", "--unverified")
    ok(db, "delete", "u1")
    before = ok(db, "list", "--json")
    line = refused(db, *change)
    assert line == "error: principal 'u1' is deleted: it can no longer be changed"
    assert ok(db, "list", "--json") == before  # nothing written
    assert "[unverified,deleted]" in ok(db, "list")
