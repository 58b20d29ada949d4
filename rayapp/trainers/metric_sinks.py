"""Where a trainer sends a step's metrics: Weights & Biases or TensorBoard, each behind an extra
(``rayapp[wandb]``, ``rayapp[tensorboard]``). A step's metrics are flat ``str -> float`` keys
(``rollout/<dataset>/reward_mean``, ``eval/<dataset>/accuracy``, ...), so a sink writes them as
they are, at the step's id.

    sink = open_sink("tensorboard", "runs/exp1")   # or open_sink("wandb", "my-project")
    sink.log(result.rollout_id, result.metrics)
    sink.close()

``open_sink`` fails at once, naming the extra, when its library is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


class TensorBoardSink:
    """Scalars into an event file under ``logdir`` (tensorboardX, else torch's writer)."""

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("the tensorboard sink needs tensorboardX: "
                                  "pip install 'rayapp[tensorboard]'") from None
        self.writer = SummaryWriter(logdir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in _finite(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run; ``kwargs`` go to ``wandb.init`` (``mode="offline"`` without a network)."""

    def __init__(self, project: str, **kwargs: Any):
        try:
            import wandb
        except ImportError:
            raise ImportError("the wandb sink needs wandb: pip install 'rayapp[wandb]'") from None
        self.run = wandb.init(project=project, **kwargs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def open_sink(kind: str, target: str, **kwargs: Any) -> MetricsSink:
    """``kind`` "tensorboard" (``target``: the log folder) or "wandb" (``target``: the project)."""
    if kind not in SINKS:
        raise ValueError(f"unknown metrics sink {kind!r}: expected one of {sorted(SINKS)}")
    return SINKS[kind](target, **kwargs)
