"""The step pipeline (docs/architecture.md): one rollout or eval step around the scheduler, from the
tasks it runs to the result a trainer gets (``runner.StepRunner``), with what a step may add (partial
rollouts, checkpoints, reuse, filters, the DAgger schedule) and what it leaves on disk."""
