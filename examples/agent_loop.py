"""A plain function-calling agent loop over agent-txn's Python API.

Run it from the repository (with the project's virtualenv)::

    .venv/bin/python examples/agent_loop.py          # you are the person: answer yes or no
    .venv/bin/python examples/agent_loop.py --yes    # a scripted person who says yes

Everything an agent runtime adds to use agent-txn is the block marked "glue" in :func:`main`:
two tools (``prepare`` and ``execute_staged_action``) and a loop that runs the model's function
calls. The protocol it follows is the one agent-txn enforces:

1. the model asks to *prepare* an action: nothing is written; the result holds a proposal in
   words for the person and an opaque confirmation token for the model;
2. the person sees the proposal and answers in a *later turn*;
3. only on "yes" does the model call ``execute_staged_action(token)``: the plan runs exactly as
   proposed, once — repeating the call replays the same result instead of charging again.

The rest of the file is the world a deployment already has (a person with grants in a room, a
stored command) and a scripted stand-in for the model, so the example runs offline on a fresh
SQLite file with the in-memory shop as provider.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledger import principals
from orchestrator.authz import Caller
from orchestrator.engine import Orchestrator
from providers.memory import MemoryShop

ROOM = "room-1"
REQUEST = "Please send order 42 (one sku-1) and charge the buyer 12.00 EUR."

#: The stored command the agent may propose: reserve the item, then charge for it (each step
#: undone by its compensation if a later one fails).
ORDER_COMMAND: dict[str, Any] = {
    "name": "order",
    "version": 1,
    "description": "Reserve the item and charge the buyer",
    "inputs": {
        "order_id": {"type": "string", "max_length": 64},
        "sku": {"type": "string"},
        "amount": {"type": "integer", "minimum": 1},
    },
    "steps": [
        {
            "kind": "effect",
            "name": "reserve",
            "provider": "inventory",
            "action": "reserve",
            "payload": {"sku": {"$ref": "inputs.sku"}, "quantity": 1},
            "compensation": {
                "action": "release",
                "payload": {"reservation_id": {"$ref": "forward.remote_id"}},
            },
        },
        {
            "kind": "effect",
            "name": "charge",
            "provider": "payments",
            "action": "charge",
            "payload": {
                "amount": {"$ref": "inputs.amount"},
                "currency": "EUR",
                "order": {"$ref": "inputs.order_id"},
            },
            "compensation": {
                "action": "refund",
                "payload": {
                    "charge_id": {"$ref": "forward.remote_id"},
                    "amount": {"$ref": "forward.payload.amount"},
                },
            },
        },
    ],
}
ACTIONS = [
    ("inventory", "reserve"),
    ("inventory", "release"),
    ("payments", "charge"),
    ("payments", "refund"),
]


async def setup(orch: Orchestrator) -> tuple[Caller, str]:
    """A person (alice) with grants, a member of the room, and the stored order command.

    A real deployment has these already (``agent-txn principals …`` and the commands API); here
    alice also authors the command, which needs the ``manage`` grant on every action it uses.
    """
    async with orch.store.transaction() as work:
        await principals.add_principal(
            work, principal_id="alice", tenant=orch.settings.tenant, kind="user", name="Alice"
        )
        for provider, action in ACTIONS:
            for permission in ("manage", "execute", "read"):
                await principals.grant(
                    work,
                    principal_id="alice",
                    provider=provider,
                    action=action,
                    permission=permission,
                )
        await principals.join_room(work, ROOM, "alice", language="en")
    # The agent acts *as* alice, in her room, marked as an AI for the audit trail.
    caller = Caller.user("alice", room_id=ROOM, ai=True)
    command = await orch.commands.create(caller, ORDER_COMMAND)
    return caller, str(command["command_id"])


class ScriptedModel:
    """A stand-in for the LLM: it reads the conversation and answers with a function call
    (``{"tool", "arguments"}``) or a plain reply (``{"content"}``), as a function-calling model
    would. It never executes in the turn it prepared: it waits for the person's answer."""

    def __init__(self, command_id: str) -> None:
        self.command_id = command_id

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        last = messages[-1]
        if len(messages) == 1:  # the person's request: propose the action
            inputs = {"order_id": "42", "sku": "sku-1", "amount": 1200}
            return {
                "tool": "prepare",
                "arguments": {"command_id": self.command_id, "inputs": inputs},
            }
        if last["role"] == "user":  # the person's answer to the proposal, in a later turn
            if last["content"].strip().lower() not in ("y", "yes", "yes, do it"):
                return {"content": "OK, I did not do anything."}
            token = messages[-2]["content"]["confirmation_token"]
            return {"tool": "execute_staged_action", "arguments": {"token": token}}
        result = last["content"]  # the closed tool result of execute_staged_action
        return {"content": f"{result['status']}: {result['guidance']}"}


async def main(ask: Callable[[str], str]) -> None:
    """One conversation: the request, the proposal, the person's answer, the result."""
    with tempfile.TemporaryDirectory() as directory:
        shop = MemoryShop()
        shop.seed_stock({"sku-1": 100})
        url = f"sqlite+aiosqlite:///{Path(directory) / 'agent.db'}"
        orch = await Orchestrator.open(url, providers=shop.providers())
        try:
            caller, command_id = await setup(orch)
            model = ScriptedModel(command_id)
            # --- glue: all an agent runtime adds to use agent-txn (9 lines) ---
            prepare, execute = orch.agent.prepare, orch.agent.execute_staged_action
            tools: dict[str, Any] = {"prepare": prepare, "execute_staged_action": execute}
            messages: list[dict[str, Any]] = [{"role": "user", "content": REQUEST}]
            while "tool" in (reply := model(messages)):  # the model asked for a function call
                result = await tools[reply["tool"]](caller, **reply["arguments"])
                messages.append({"role": "tool", "content": result})
                if "proposal" in result:  # the person reads the plan and answers in a later turn
                    messages.append({"role": "user", "content": ask(f"{result['proposal']}\n> ")})
            print(reply["content"])
            # --- end of glue ---
            print(f"charges in the shop: {shop.counts()['payments.charge']}")
        finally:
            await orch.close()


def scripted_yes(prompt: str) -> str:
    """The person of ``--yes``: reads the proposal and agrees (printed as if typed)."""
    print(f"{prompt}yes")
    return "yes"


if __name__ == "__main__":
    asyncio.run(main(scripted_yes if "--yes" in sys.argv[1:] else input))
