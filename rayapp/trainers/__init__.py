"""Adapters that let a trainer's own loop take its rollouts from rayapp (docs/trainers.md).

Each adapter is its own module and imports its trainer only there: ``import rayapp`` (and this
package) never imports a trainer, so the trainers stay optional extras (``rayapp[trl]``).
"""
