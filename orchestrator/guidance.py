# Full-width punctuation is correct Traditional Chinese; message tables read best unwrapped.
# ruff: noqa: RUF001, E501
"""What the person reads: the proposal before a staged action, and the fixed guidance after it.

Both are built here from fixed strings, in the room's language (``en`` and ``zh-TW``). The
proposal shows business data — the command's purpose, the actions, amounts and targets, input
values (even those that merely look like UUIDs or digests) — and never the server's structure:
no digest, confirmation token or reference, transaction or execution ids, keys or headers.
Values taken from query results (``queries.…``) are fixed at prepare and are what the plan will
send, so they are shown too: the person must see the amount they confirm. Values that would come
from the server (``tx.id``) or from results not known before the plan runs (``steps.…``) are left
out rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from orchestrator import expressions
from orchestrator.definitions import StoredCommand

LANGUAGES: Final = ("en", "zh-TW")
MAX_PROPOSAL_CHARS: Final = 1200
_MAX_VALUE_CHARS: Final = 80

_GUIDANCE: Final[Mapping[str, Mapping[str, str]]] = {
    "succeeded": {
        "en": "Done. Tell the person what was completed.",
        "zh-TW": "已完成。請告訴對方完成了哪些事項。",
    },
    "staged": {
        "en": "The plan is ready and waits for the person's explicit confirmation.",
        "zh-TW": "計畫已備妥，正等待對方明確確認。",
    },
    "approval_required": {
        "en": "An approver must approve this before it runs. Nothing has been done yet.",
        "zh-TW": "此操作需經核准者核准才會執行，目前尚未進行任何變更。",
    },
    "in_doubt": {
        "en": "It is still being confirmed with the provider. Do not repeat it; check its status later.",
        "zh-TW": "仍在向服務提供者確認中。請勿重複操作，稍後再查詢狀態。",
    },
    "manual_review": {
        "en": "It needs a person on the operations team to decide. Do not repeat it.",
        "zh-TW": "需要營運人員決定後續處理。請勿重複操作。",
    },
    "assertion_failed": {
        "en": "It was not done: a check of the action failed. Nothing was changed.",
        "zh-TW": "未執行：動作的檢查條件未通過，沒有任何變更。",
    },
    "cap_exceeded": {
        "en": "It was not done: it exceeds an allowed limit. Nothing was changed.",
        "zh-TW": "未執行：超過允許的上限，沒有任何變更。",
    },
    "cardinality_failed": {
        "en": "It was not done: the records it needs were not found as expected. Nothing was changed.",
        "zh-TW": "未執行：找不到預期的資料，沒有任何變更。",
    },
    "command_input_invalid": {
        "en": "It was not done: some details are missing or invalid. Ask the person to correct them.",
        "zh-TW": "未執行：部分資料缺漏或不正確，請對方更正。",
    },
    "command_rule_failed": {
        "en": "It was not done: a rule of this action does not allow it. Nothing was changed.",
        "zh-TW": "未執行：此動作的規則不允許，沒有任何變更。",
    },
    "provider_rejected": {
        "en": "It was not done: the service declined it. Anything started was reversed.",
        "zh-TW": "未執行：服務拒絕了此請求，已開始的部分都已撤回。",
    },
    "command_contract_mismatch": {
        "en": "The action changed since it was proposed. Prepare it again and ask the person to confirm.",
        "zh-TW": "此動作在提議後已變更。請重新準備並再次請對方確認。",
    },
    "schema_dependency_changed": {
        "en": "The action's dependencies changed. Nothing was done; it needs to be reviewed again.",
        "zh-TW": "此動作依賴的設定已變更，未執行任何變更，需要重新審查。",
    },
    "source_authority_changed": {
        "en": "The action was edited while it was starting. Nothing was done; prepare it again.",
        "zh-TW": "此動作在啟動時被修改，未執行任何變更，請重新準備。",
    },
    "confirmation_invalid": {
        "en": "This confirmation is no longer valid. Prepare the action again.",
        "zh-TW": "此確認已失效，請重新準備動作。",
    },
    "room_write_protected": {
        "en": "Changes are paused in this room until earlier replies are delivered. Try again later.",
        "zh-TW": "在先前的回覆送達前，此聊天室暫停變更。請稍後再試。",
    },
    "principal_not_authorized": {
        "en": "The person is not allowed to do this.",
        "zh-TW": "對方沒有執行此操作的權限。",
    },
    "business_key_committed": {
        "en": "This was already done earlier, so it was not done again. Tell the person it is already done.",
        "zh-TW": "此事先前已完成，因此沒有再執行一次。請告訴對方已經完成。",
    },
    "command_lock_conflict": {
        "en": "It was busy; nothing was changed. It is safe to try again.",
        "zh-TW": "系統忙碌中，沒有任何變更，可以安全地再試一次。",
    },
    "_default": {
        "en": "It was not done. Nothing was changed that was not reversed.",
        "zh-TW": "未執行。任何已開始的變更都已撤回。",
    },
}

_PROPOSAL: Final[Mapping[str, Mapping[str, str]]] = {
    "intro": {
        "en": 'I am ready to run "{title}". This will:',
        "zh-TW": "我準備執行「{title}」。這會：",
    },
    "then": {"en": "Afterwards it will send: {events}.", "zh-TW": "完成後會送出：{events}。"},
    "approval": {
        "en": "An approver must also approve it before it runs.",
        "zh-TW": "執行前還需要核准者核准。",
    },
    "ask": {
        "en": 'Reply "yes" to go ahead, or tell me what to change.',
        "zh-TW": "請回覆「確認」以繼續，或告訴我要修改什麼。",
    },
    "step": {
        "en": "- {action} ({provider}){details}",
        "zh-TW": "- {action}（{provider}）{details}",
    },
}


def _lang(language: str) -> str:
    return language if language in LANGUAGES else "en"


def guidance_for(code: str, language: str) -> str:
    """The fixed guidance for a status or error code in ``language`` (English fallback)."""
    table = _GUIDANCE.get(code) or _GUIDANCE["_default"]
    return table[_lang(language)]


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else expressions_repr(value)
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 1] + "…"


def expressions_repr(value: Any) -> str:
    """A compact plain rendering of a business value."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(expressions_repr(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {expressions_repr(v)}" for k, v in value.items())
    return str(value)


#: The scope roots fixed at prepare: the validated inputs and the query results. A payload
#: field over these renders now to exactly what the plan will send.
_KNOWN_AT_PREPARE: Final = ("inputs", "queries")


def _known_at_prepare(ref: str) -> bool:
    return ref.split(".", 1)[0] in _KNOWN_AT_PREPARE


def _business_fields(
    template: Any, inputs: Mapping[str, Any], queries: Mapping[str, Any]
) -> list[tuple[str, Any]]:
    """Payload fields whose value is known before the plan runs and is business data: literals
    and values taken from the inputs or the query results (both fixed at prepare, so hiding
    them would hide what the person confirms). Server-made and later-known values are left
    out."""
    if not isinstance(template, Mapping):
        return []
    scope = {"inputs": dict(inputs), "queries": dict(queries)}
    out: list[tuple[str, Any]] = []
    for field, expr in template.items():
        if not all(_known_at_prepare(r) for r in expressions.refs(expr)):
            continue  # tx ids, step results: structural or not yet known
        try:
            out.append((str(field), expressions.render(expr, scope)))
        except expressions.ExpressionError:
            continue
    return out


def proposal_text(
    stored: StoredCommand,
    inputs: Mapping[str, Any],
    language: str,
    *,
    needs_approval: bool,
    queries: Mapping[str, Any] | None = None,
) -> str:
    """The bounded proposal the person confirms: what will happen, amounts and targets.

    ``queries`` are the query results fixed at prepare (``prepared.queries``): the staged plan
    renders its payloads over them, so the proposal does too."""
    lang = _lang(language)
    title = str(stored.data.get("description") or stored.name).strip() or stored.name
    lines = [_PROPOSAL["intro"][lang].format(title=_shown(title))]
    for step in stored.effect_steps:
        fields = _business_fields(step.get("payload"), inputs, queries or {})
        details = "; ".join(f"{k}: {_shown(v)}" for k, v in fields)
        lines.append(
            _PROPOSAL["step"][lang].format(
                action=step["action"],
                provider=step["provider"],
                details=(" — " + details) if details else "",
            )
        )
    events = [f"{e['action']} ({e['provider']})" for e in stored.data.get("outbox", [])]
    if events:
        lines.append(_PROPOSAL["then"][lang].format(events=", ".join(events)))
    if needs_approval:
        lines.append(_PROPOSAL["approval"][lang])
    lines.append(_PROPOSAL["ask"][lang])
    text = "\n".join(lines)
    if len(text) > MAX_PROPOSAL_CHARS:
        text = text[: MAX_PROPOSAL_CHARS - 1] + "…"
    return text
