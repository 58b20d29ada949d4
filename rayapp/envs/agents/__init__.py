"""Agents: the handlers an EvaluatorSpec binds (spec §4)."""
