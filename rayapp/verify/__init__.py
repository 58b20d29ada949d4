"""Verifiers that score answers the way the task family defines them."""

from rayapp.verify.math_answers import MathVerifier, verify_math, verify_math_async

__all__ = ["MathVerifier", "verify_math", "verify_math_async"]
