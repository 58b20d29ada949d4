"""Agents: the handlers an EvaluatorSpec binds (docs/scheduler.md §4)."""
