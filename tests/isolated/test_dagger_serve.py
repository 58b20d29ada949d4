"""The DAgger recipe end to end (`serve run recipes/dagger_local/rollout.yaml`): the training
driver's three iterations, then a manager replica killed mid-rollout that resumes from its
checkpoint. On the isolated files' shared Ray head."""

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT
from rayapp.types import Status

RECIPE = ROOT / "recipes" / "dagger_local" / "rollout.yaml"


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dagger")
    cfg = yaml.safe_load(RECIPE.read_text())
    args = cfg["applications"][0]["args"]
    run_dir = tmp / "run"  # this test's own run folder instead of the recipe's /tmp one
    args["scheduler"] |= {"save_eval_details": str(run_dir), "trajectory_dir": str(run_dir / "trajectories"),
                          "checkpoint_dir": str(run_dir / "checkpoints")}
    with serve_app(head, cfg, tmp):
        yield {"address": head.address, "run": run_dir, "args": args, "log": tmp / "serve.log"}


def test_the_driver_runs_three_dagger_iterations(app):
    from rayapp.steps.trajectories import load_trajectories

    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "driver.py"), f"--address={app['address']}",
                          "--rollouts", "3", "--eval"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    iterations = re.findall(r"^iteration (\d): beta=([\d.]+) t_max=(\d+); roll-in turns by teacher (\d+), "
                            r"by student (\d+); teacher labels for student turns (\d+)$", text, re.M)
    assert [(int(i), float(b), int(t)) for i, b, t, *_ in iterations] == [(0, 1.0, 1), (1, 0.5, 2), (2, 0.0, 3)]
    teacher_turns = [int(x[3]) for x in iterations]
    assert teacher_turns[0] > 0 and teacher_turns[2] == 0  # β=1 at iteration 0, student-only at β=0
    assert int(iterations[2][4]) == int(iterations[2][5]) > 0  # every student turn got the teacher's label
    assert re.findall(r"^\[[\d.]+s\] eval (\d) \(beta=0\.0\):$", text, re.M) == ["0", "1", "2"]
    assert len(re.findall(r"^  filters: kept \d+ of 4 groups, \d+ of 8 samples; samples dropped", text, re.M)) == 3
    artifacts = re.findall(r"^  artifact (\w+) +(\S+)$", text, re.M)
    kinds = [k for k, _ in artifacts]
    for kind in ("checkpoint", "train_summary", "trajectory", "trajectory_iter", "samples", "placement", "summary"):
        assert kinds.count(kind) == 3, (kind, kinds)
    assert all(Path(p).exists() for _, p in artifacts), artifacts

    # the per-iteration trajectories hold every sample (before the filters) with who acted per turn
    for it, check in ((0, lambda actors: actors[0] == "teacher" and set(actors[1:]) <= {"student"}),
                      (2, lambda actors: set(actors) == {"student"})):
        rid, groups = load_trajectories(app["run"] / "trajectories" / f"trajectory_sft_samples_iter_{it:03d}.pt")
        assert rid == it and len(groups) == 4
        ran = [s for g in groups for s in g if s.status is not Status.ABORTED]
        actors = [[str(t.actor) for t in s.episode.turn_records] for s in ran]  # read back into the record
        assert ran and all(check(a) for a in actors), actors
        if it == 2:
            assert all(len(s.episode.dagger_labels) == len(a) for s, a in zip(ran, actors, strict=True))


def kill_mid_rollout(ray, handle, rid, folder, checkpoints):
    """Start rollout ``rid``, kill the manager replica once a group of it is on disk; what the
    checkpoint then holds (None when the step finished first)."""
    for _ in range(60):  # a replica killed before: wait until Serve has replaced it
        try:
            handle.status.remote().result(timeout_s=30)
            break
        except Exception:
            time.sleep(1)
    step = handle.generate.remote(rid)
    deadline = time.monotonic() + 300
    while not list(folder.glob("group_*.msgpack")):
        assert time.monotonic() < deadline, f"no group of rollout {rid} finished within 300 s"
        time.sleep(0.1)
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA") and "SchedulerRolloutManager" in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    with contextlib.suppress(Exception):  # the caller sees the replica die, whatever Ray calls it
        step.result(timeout_s=120)
    return checkpoints.resume(rid)


def test_a_killed_manager_replica_resumes_its_rollout_without_loss_or_duplicates(app):
    import ray
    from ray import serve

    from rayapp.recipe import build_data_source, parse_recipe
    from rayapp.steps.checkpoint import RolloutCheckpoint
    from rayapp.steps.trajectories import load_trajectories

    ray.init(address=app["address"], namespace="rayapp-resume", logging_level="error", log_to_driver=False)
    try:
        h = serve.get_app_handle("rayapp")
        checkpoints = RolloutCheckpoint(app["run"] / "checkpoints")
        for rid in (3, 4, 5):  # a step whose groups all finish before the kill lands is tried again with the next
            before = kill_mid_rollout(ray, h, rid, app["run"] / "checkpoints" / f"rollout_{rid:06d}", checkpoints)
            if before is not None:
                break
        assert before is not None and before.groups, "no kill landed mid-rollout in three tries"

        result = None
        for _ in range(30):  # until Serve has replaced the replica
            try:
                result = h.generate.remote(rid).result(timeout_s=600)
                break
            except Exception:  # the dead replica's errors while Serve replaces it
                time.sleep(2)
        assert result is not None, app["log"].read_text()[-3000:]
        assert result.metrics["rollout/resumed_groups"] == len(before.groups)
        assert checkpoints.resume(rid) is None  # finished

        # what the trainer gets (saved before the filters): the tasks the source gives from the saved
        # state, in fetch order, each group whole; the groups finished before the kill, as recorded
        _, groups = load_trajectories(app["run"] / "trajectories" / f"trajectory_sft_samples_iter_{rid:03d}.pt")
        source = build_data_source(parse_recipe(app["args"]))
        source.load_state_dict(before.source_state)
        assert [g[0].task_id for g in groups] == [t.task_id for t in source.take(4)]
        assert all([s.index for s in g] == [0, 1] for g in groups)
        for i, group in before.groups.items():
            assert groups[i] == group  # not re-run: same tokens, rewards, placement group names
        placement = h.placement.remote().result(timeout_s=60)
        assert placement["held_tokens"] == 0 and placement["batches"] == {} and placement["waiting"] == 0
    finally:
        ray.shutdown()
