"""Saga definitions shared by the tests: the suite's own (one definition of the seed's order)."""

from fault_injection.sagas import order, order_saga

__all__ = ["order", "order_saga"]
