"""Metrics sinks: a step's flat metrics reach TensorBoard and wandb as they are (each test skips
without its extra); a missing library or an unknown sink is one clear error."""

import pytest

from rayapp.trainers.metric_sinks import open_sink

METRICS = {"rollout/math/reward_mean": 0.25, "rollout/samples_per_s": 3.5, "eval/math/accuracy": 0.5,
           "rollout/odd": float("nan")}


def test_tensorboard_gets_every_finite_key_at_the_steps_id(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")  # its event reader checks what was written
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = open_sink("tensorboard", str(tmp_path))
    sink.log(3, METRICS)
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(METRICS) - {"rollout/odd"}
    assert [(e.step, e.value) for e in acc.Scalars("rollout/math/reward_mean")] == [(3, 0.25)]


def test_wandb_logs_the_keys_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = open_sink("wandb", "rayapp-test", mode="offline", dir=str(tmp_path))
    logged, real = [], sink.run.log

    def log(data, step=None):  # what reaches the real run's log, which still takes it
        logged.append((step, dict(data)))
        return real(data, step=step)

    sink.run.log = log
    sink.log(1, METRICS)
    sink.close()
    assert wandb.run is None  # finished
    assert logged == [(1, {k: v for k, v in METRICS.items() if k != "rollout/odd"})]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # the run's record, for `wandb sync`


def test_an_unknown_sink_is_refused():
    with pytest.raises(ValueError, match="unknown metrics sink 'mlflow'"):
        open_sink("mlflow", "x")
