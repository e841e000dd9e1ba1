"""The one error-code registry, and the error tree callers catch.

::

    AgentTxnError                      every error agent-txn raises to a caller
    ├── DefinitionInvalid              saga_definition_invalid       400  author
    ├── UnknownProviderError           unknown_provider              400  author
    ├── UnknownActionError             unknown_action                400  author
    ├── InputInvalid                   command_input_invalid         400  execute
    ├── IdentifierInvalid              invalid_identifier            400  execute
    ├── PayloadNotSerializable         payload_not_serializable      400  execute
    ├── IdempotencyPayloadMismatch     idempotency_payload_mismatch  409  execute
    ├── BusinessKeyConflict            business_key_conflict         409  execute  retryable
    ├── BusinessKeyCommitted           business_key_committed        409  execute
    ├── LockConflict                   command_lock_conflict         409  execute  retryable
    ├── ValueNotStorableError          value_not_storable            400  execute
    ├── StoreUnavailableError          store_unavailable             503  execute  retryable
    ├── SchemaOutdatedError            schema_outdated               500  execute
    ├── TransactionNotFound            transaction_not_found         404  execute
    ├── NotResolvable                  not_resolvable                409  execute
    └── ExecutionFailed                command_execution_failed      500  execute  (the fallback)

Codes that only appear as a saga's *outcome* (``SagaResult.error``), not as exceptions:
``provider_rejected``, ``validation_failed``, ``manual_review``, ``in_doubt``.

Each code is registered once with its HTTP status, whether a retry of the same call may succeed,
its phases and the detail keys it may carry. :func:`envelope` builds the closed error envelope
``{error, phase, message, retryable, details, step?, path?}``; anything unregistered or carrying
unregistered details degrades to ``command_execution_failed`` and leaks nothing. Messages are
fixed strings chosen here: no provider or database text is ever copied in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

PHASES: Final = frozenset({"author", "execute", "stage", "release", "callback"})


@dataclass(frozen=True, slots=True)
class ErrorCode:
    """A registered error code."""

    code: str
    http_status: int
    retryable: bool
    message: str
    phases: frozenset[str] = frozenset({"execute"})
    detail_keys: frozenset[str] = frozenset()


REGISTRY: dict[str, ErrorCode] = {}


def register(code: ErrorCode) -> ErrorCode:
    """Add ``code`` to the registry (once)."""
    if code.code in REGISTRY:
        raise ValueError(f"error code {code.code!r} registered twice")
    REGISTRY[code.code] = code
    return code


def _reg(
    code: str,
    status: int,
    message: str,
    *,
    retryable: bool = False,
    phases: tuple[str, ...] = ("execute",),
    details: tuple[str, ...] = (),
) -> ErrorCode:
    return register(
        ErrorCode(code, status, retryable, message, frozenset(phases), frozenset(details))
    )


FALLBACK = _reg("command_execution_failed", 500, "The command could not be executed.")
_reg(
    "saga_definition_invalid",
    400,
    "The saga definition is invalid.",
    phases=("author",),
    details=("reason", "step"),
)
_reg(
    "unknown_provider",
    400,
    "The saga names a provider that is not registered.",
    phases=("author", "execute"),
    details=("provider",),
)
_reg(
    "unknown_action",
    400,
    "The saga names an action the provider does not offer.",
    phases=("author", "execute"),
    details=("provider", "action"),
)
_reg(
    "command_input_invalid",
    400,
    "The inputs do not match the saga's input schema.",
    details=("errors",),
)
_reg("invalid_identifier", 400, "An id or key is empty, blank or malformed.", details=("field",))
_reg(
    "payload_not_serializable",
    400,
    "A rendered payload has no canonical JSON form.",
    details=("step",),
)
_reg(
    "idempotency_payload_mismatch",
    409,
    "The same key was used with a different payload.",
    details=("field",),
)
_reg(
    "business_key_conflict",
    409,
    "Another transaction for the same business key is still in flight.",
    retryable=True,
    details=("business_key", "tx_id", "execution_id"),
)
# The holder committed: the business action already ran, and it keeps the key for good, so a
# retry can never succeed (``business_key_conflict`` said "retry" and clients retried forever).
_reg(
    "business_key_committed",
    409,
    "The business action for this key already ran; it is not run again.",
    phases=("execute", "stage"),
    details=("business_key", "tx_id", "execution_id"),
)
_reg(
    "command_lock_conflict",
    409,
    "Concurrent write conflict (lock); please retry the request.",
    retryable=True,
)
# The database refused a value too long or too large for its column; each is meant to be
# refused where it enters, so this only answers for a check that let one through.
_reg(
    "value_not_storable",
    400,
    "A value is too long or out of range for the database.",
    phases=("author", "execute", "stage", "release"),
)
_reg("store_unavailable", 503, "The database is unavailable; please retry.", retryable=True)
_reg("schema_outdated", 500, "The database schema needs `agent-txn db upgrade`.")
_reg("transaction_not_found", 404, "Transaction not found.", details=("tx_id",))
_reg(
    "not_resolvable",
    409,
    "That effect is not waiting for a manual decision.",
    details=("tx_id", "op"),
)
# -- commands layer (seed 000) ------------------------------------------------------------------
_reg("command_not_found", 404, "Command not found.", phases=("author", "execute"))
_reg("command_execution_not_found", 404, "Command execution not found.")
_reg(
    "command_contract_mismatch",
    409,
    "The command definition changed since it was reviewed.",
)
_reg("jwt_required", 403, "Command routes require JWT authentication", phases=tuple(PHASES))
_reg(
    "principal_not_authorized",
    403,
    "Command principal is not authorized",
    phases=tuple(PHASES),
)
_reg(
    "field_not_readable",
    403,
    "A result field of the command is not readable by the caller.",
    details=("field",),
)
_reg(
    "idempotency_in_progress",
    409,
    "An execution with this idempotency key is still in progress.",
    retryable=True,
    details=("execution_id",),
)
_reg(
    "idempotency_key_invalid",
    400,
    "The idempotency key must be 1 to 128 characters.",
    details=("field",),
)
_reg(
    "contract_digest_invalid",
    400,
    "expected_contract_digest must be 64 lowercase hexadecimal characters.",
    details=("field",),
)
_reg("schema_dependency_changed", 409, "Command schema dependencies changed")
_reg("source_authority_changed", 409, "Command authority changed before execution")
_reg(
    "action_locked",
    400,
    "Action is currently locked for an operation.",
    details=("provider", "action", "operation"),
)
_reg(
    "assertion_failed",
    400,
    "An assertion of the command failed.",
    details=("step",),
)
_reg("cap_exceeded", 400, "A cap of the command was exceeded.", details=("cap", "limit", "actual"))
_reg(
    "cardinality_failed",
    400,
    "A query returned an unexpected number of items.",
    details=("step", "min", "max", "actual"),
)
_reg("command_rule_failed", 400, "A rule of the command does not hold.", details=("rule",))
for _code in ("query", "relation", "mutation", "output"):
    _reg(
        f"{_code}_limit_exceeded",
        400,
        f"The command exceeds the {_code} budget.",
        details=("resource", "limit", "actual"),
    )
_reg(
    "definition_limit_exceeded",
    400,
    "The command definition exceeds an authoring budget.",
    phases=("author",),
    details=("resource", "limit", "actual"),
)
_reg(
    "input_limit_exceeded",
    400,
    "The command inputs exceed the size budget.",
    details=("resource", "limit", "actual"),
)
_reg("command_timeout", 504, "The command did not finish in time.", details=("limit",))
_reg("query_timeout", 504, "The query did not finish in time.", details=("limit",))
_reg(
    "command_mode_mismatch",
    400,
    "This command cannot run in that mode.",
    details=("mode",),
)
_reg(
    "request_invalid",
    422,
    "The request is malformed.",
    phases=tuple(PHASES),
    details=("errors",),
)
_reg(
    "provider_unavailable",
    503,
    "A provider could not answer a query; please retry.",
    retryable=True,
    details=("step",),
)
_reg("staged_change_not_found", 404, "Staged change not found.", phases=("stage", "release"))
_reg(
    "staged_change_decided",
    409,
    "The staged change was already decided.",
    phases=("stage", "release"),
)
_reg("approval_rejected", 409, "An approver rejected the staged change.", phases=("release",))
_reg("staged_released", 409, "The staged plan was released without running.", phases=("release",))
_reg(
    "confirmation_invalid",
    404,
    "The confirmation is unknown, expired or not yours.",
    phases=("stage", "execute"),
)
_reg(
    "room_write_protected",
    409,
    "Writes in this room are paused until pending deliveries are settled.",
    retryable=True,
    phases=("stage", "execute"),
)
_reg(
    "approval_required",
    409,
    "The command needs an approval before it runs.",
    phases=("execute", "stage"),
    details=("staged_change_id",),
)

# Outcome codes (SagaResult.error), registered so envelopes built from them validate.
_reg("provider_rejected", 422, "The provider declined the request.", details=("step",))
_reg("validation_failed", 422, "A post-condition of the saga did not hold.", details=("check",))
_reg(
    "manual_review",
    202,
    "The transaction is parked for a person to decide.",
    details=("step", "reason"),
)
_reg(
    "in_doubt",
    202,
    "An effect is still being reconciled; workers will finish it.",
    retryable=True,
    details=("step",),
)


class AgentTxnError(Exception):
    """Base of every error agent-txn raises to a caller; ``code`` names its registry entry."""

    code: ClassVar[str] = FALLBACK.code

    def __init__(
        self,
        message: str | None = None,
        *,
        details: Mapping[str, Any] | None = None,
        step: str | None = None,
        path: str | None = None,
    ) -> None:
        entry = REGISTRY[self.code]
        self.message = message or entry.message
        self.details = dict(details or {})
        self.step = step
        self.path = path
        super().__init__(self.message)

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed if repeated."""
        return REGISTRY[self.code].retryable

    @property
    def http_status(self) -> int:
        """The HTTP status this code maps to."""
        return REGISTRY[self.code].http_status

    def envelope(self, phase: str = "execute") -> dict[str, Any]:
        """The closed error envelope for this error."""
        return envelope(
            self.code,
            phase=phase,
            message=self.message,
            details=self.details,
            step=self.step,
            path=self.path,
        )


class DefinitionInvalid(AgentTxnError):
    """The saga definition breaks a rule (shape, references, unknown operator ...)."""

    code = "saga_definition_invalid"


class UnknownProviderError(AgentTxnError):
    """A step names a provider that is not registered."""

    code = "unknown_provider"


class UnknownActionError(AgentTxnError):
    """A step names an action its provider does not offer."""

    code = "unknown_action"


class InputInvalid(AgentTxnError):
    """Inputs do not validate against the saga's input schema."""

    code = "command_input_invalid"


class IdentifierInvalid(AgentTxnError):
    """An id or key is empty, blank, too long or has characters outside its alphabet."""

    code = "invalid_identifier"


class PayloadNotSerializable(AgentTxnError):
    """A payload cannot be written as canonical JSON."""

    code = "payload_not_serializable"


class IdempotencyPayloadMismatch(AgentTxnError):
    """The same key arrived with a different payload fingerprint: refused, never guessed."""

    code = "idempotency_payload_mismatch"


class BusinessKeyConflict(AgentTxnError):
    """Another live transaction holds the business key (it may still fail and free it)."""

    code = "business_key_conflict"


class BusinessKeyCommitted(AgentTxnError):
    """A committed transaction holds the business key: that business action already ran."""

    code = "business_key_committed"


class LockConflict(AgentTxnError):
    """Lock contention outlasted the in-server retries; nothing partial landed."""

    code = "command_lock_conflict"


class ValueNotStorableError(AgentTxnError):
    """The database refused a value as too long or out of range for its column (a
    :class:`ledger.errors.ValueNotStorable`); nothing was written, and the same value fails
    again."""

    code = "value_not_storable"


class StoreUnavailableError(AgentTxnError):
    """The database could not be reached."""

    code = "store_unavailable"


class SchemaOutdatedError(AgentTxnError):
    """The database is behind this package's migrations."""

    code = "schema_outdated"


class TransactionNotFound(AgentTxnError):
    """No transaction with that id."""

    code = "transaction_not_found"


class NotResolvable(AgentTxnError):
    """An operator asked to resolve an effect that is not parked."""

    code = "not_resolvable"


class ExecutionFailed(AgentTxnError):
    """Anything unexpected: the fallback that leaks nothing."""

    code = FALLBACK.code


# -- commands layer -----------------------------------------------------------------------------


class CommandNotFound(AgentTxnError):
    """No visible command with that id (also: soft-deleted, another tenant's)."""

    code = "command_not_found"


class ExecutionNotFound(AgentTxnError):
    """No execution with that id that the caller may see."""

    code = "command_execution_not_found"


class ContractMismatch(AgentTxnError):
    """``expected_contract_digest`` differs from the stored definition's digest."""

    code = "command_contract_mismatch"


class JwtRequired(AgentTxnError):
    """Command routes take a user's JWT, not an API key."""

    code = "jwt_required"


class PrincipalNotAuthorized(AgentTxnError):
    """Any principal failure: unknown, wrong tenant, disabled, unverified, not a member, no grant.

    One code and one message for all of them, so a caller cannot tell which (nor probe ids)."""

    code = "principal_not_authorized"


class FieldNotReadable(AgentTxnError):
    """The command's result projects a field the caller may not read."""

    code = "field_not_readable"


class IdempotencyInProgress(AgentTxnError):
    """The key belongs to an execution that is still running or parked."""

    code = "idempotency_in_progress"


class IdempotencyKeyInvalid(AgentTxnError):
    """The idempotency key is empty or longer than 128 characters."""

    code = "idempotency_key_invalid"


class ContractDigestInvalid(AgentTxnError):
    """``expected_contract_digest`` is not 64 lowercase hex characters."""

    code = "contract_digest_invalid"


class SchemaDependencyChanged(AgentTxnError):
    """A provider action the command depends on changed (drift)."""

    code = "schema_dependency_changed"


class SourceAuthorityChanged(AgentTxnError):
    """The command row changed (or was deleted) between validation and apply."""

    code = "source_authority_changed"


class ActionLocked(AgentTxnError):
    """A referenced provider action is held by an operation (a migration)."""

    code = "action_locked"


class AssertionFailed(AgentTxnError):
    """An assert step of the command was false; nothing was written (or all of it reversed)."""

    code = "assertion_failed"


class CapExceeded(AgentTxnError):
    """A cap of the command was exceeded; nothing was written."""

    code = "cap_exceeded"


class CardinalityFailed(AgentTxnError):
    """A query step returned fewer or more items than the command expects."""

    code = "cardinality_failed"


class RuleFailed(AgentTxnError):
    """A rule of the command does not hold for these inputs; nothing was written."""

    code = "command_rule_failed"


class LimitExceeded(AgentTxnError):
    """A runtime budget (``query``, ``relation``, ``mutation``, ``output``) was exceeded."""

    def __init__(self, kind: str, *, limit: int, actual: int, resource: str | None = None) -> None:
        self.code = f"{kind}_limit_exceeded"  # type: ignore[misc]
        super().__init__(details={"resource": resource or kind, "limit": limit, "actual": actual})


class DefinitionLimitExceeded(AgentTxnError):
    """The definition exceeds an authoring budget."""

    code = "definition_limit_exceeded"


class InputLimitExceeded(AgentTxnError):
    """The request's inputs exceed the size budget."""

    code = "input_limit_exceeded"


class CommandTimeout(AgentTxnError):
    """The command's time budget ended before anything was written."""

    code = "command_timeout"


class QueryTimeout(AgentTxnError):
    """A query did not finish within its time budget."""

    code = "query_timeout"


class CommandModeMismatch(AgentTxnError):
    """``execute`` on a query-mode command, or ``query`` on an execute-mode one."""

    code = "command_mode_mismatch"


class RequestInvalid(AgentTxnError):
    """The HTTP request body or parameters do not validate."""

    code = "request_invalid"


class ProviderUnavailable(AgentTxnError):
    """A query step's provider did not answer (reads only: nothing was written)."""

    code = "provider_unavailable"


class OutcomeError(AgentTxnError):
    """A command's saga ended without committing: its registered code, the execution it left.

    ``details`` are filtered to the code's allowed keys so nothing unregistered leaks."""

    def __init__(
        self,
        code: str,
        *,
        message: str | None = None,
        details: Mapping[str, Any] | None = None,
        step: str | None = None,
        execution_id: str | None = None,
    ) -> None:
        entry = REGISTRY.get(code, FALLBACK)
        self.code = entry.code  # type: ignore[misc]
        allowed = {k: v for k, v in (details or {}).items() if k in entry.detail_keys}
        super().__init__(message if entry is not FALLBACK else None, details=allowed, step=step)
        self.execution_id = execution_id


class ApprovalRequired(AgentTxnError):
    """The command needs an approver's decision; its plan is staged (``staged_change_id``)."""

    code = "approval_required"


class StagedChangeNotFound(AgentTxnError):
    """No staged change with that id in this tenant."""

    code = "staged_change_not_found"


class StagedChangeDecided(AgentTxnError):
    """The staged change was approved or rejected already (each decides once)."""

    code = "staged_change_decided"


class ConfirmationInvalid(AgentTxnError):
    """An agent's confirmation token is unknown, expired, used up or another person's."""

    code = "confirmation_invalid"


class RoomWriteProtected(AgentTxnError):
    """The room's delivery window is full: mutating commands fail closed until it frees."""

    code = "room_write_protected"


def envelope(
    code: str,
    *,
    phase: str = "execute",
    message: str | None = None,
    details: Mapping[str, Any] | None = None,
    step: str | None = None,
    path: str | None = None,
) -> dict[str, Any]:
    """The closed envelope; unregistered codes, phases or detail keys degrade to the fallback."""
    entry = REGISTRY.get(code)
    details = dict(details or {})
    if entry is None or phase not in PHASES or not set(details) <= entry.detail_keys:
        entry, details, message, step, path = FALLBACK, {}, None, None, None
        phase = phase if phase in PHASES else "execute"
    out: dict[str, Any] = {
        "error": entry.code,
        "phase": phase,
        "message": message or entry.message,
        "retryable": entry.retryable,
        "details": details,
    }
    if step is not None:
        out["step"] = step
    if path is not None:
        out["path"] = path
    return out
