"""Compensation: reverse plans built from confirmed operations, and the policy around them."""

from compensation.planner import PlanningError, ReversalSpec, ReversePlan, plan_reversal
from compensation.policy import RetryBudget

__all__ = ["PlanningError", "RetryBudget", "ReversalSpec", "ReversePlan", "plan_reversal"]
