"""Everything a trainer touches (docs/trainers.md): the step result as a trainer gets it
(``converters``), the tasks a trainer chooses for a step (``step_tasks``), metric sinks, the built-in
GRPO trainer (``grpo``), and the adapters that let a trainer's own loop take its rollouts from rayapp.

Each adapter is its own module and imports its trainer only there: ``import rayapp`` (and this
package) never imports a trainer, so the trainers stay optional extras (``rayapp[trl]``).
"""
