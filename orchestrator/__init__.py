"""agent-txn's orchestrator: saga definitions, the effect protocol, the engine facade."""

from orchestrator.config import EngineSettings
from orchestrator.crashpoints import CrashPoints, SimulatedCrash
from orchestrator.engine import Orchestrator, RecoveryReport
from orchestrator.errors import AgentTxnError
from orchestrator.expressions import ref
from orchestrator.saga import Check, Compensation, Event, Input, Saga, SagaDefinition, Step
from orchestrator.views import ErrorInfo, SagaResult, TransactionView

__all__ = [
    "AgentTxnError",
    "Check",
    "Compensation",
    "CrashPoints",
    "EngineSettings",
    "ErrorInfo",
    "Event",
    "Input",
    "Orchestrator",
    "RecoveryReport",
    "Saga",
    "SagaDefinition",
    "SagaResult",
    "SimulatedCrash",
    "Step",
    "TransactionView",
    "ref",
]
