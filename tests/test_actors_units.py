"""The Ray shell's pure parts, without a cluster: recipe validation and the app builder's checks.
(The pool and engine clients' bounds and error mapping: test_remote_calls.py.)"""

import pytest
import yaml

from rayapp.actors.recipe import RecipeError, apply_env, parse_recipe
from rayapp.cli import ROOT
from rayapp.types import Resource

LOCAL = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]


def test_the_local_recipe_parses():
    cfg = parse_recipe(LOCAL)
    assert cfg.engines["student"].backend == "hf" and cfg.pool.gate
    assert cfg.evaluators[0].run_resource == Resource(gpu=0.25, cpu=0.5, memory_gb=1)
    assert [e.env for e in cfg.evaluators] == ["arithmetic", "math", "humaneval", "swe"]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a["evaluators"][0]["resource"].update(gpu="lots"), r"\$\.evaluators\[0\]\.resource\.gpu"),
    (lambda a: a["evaluators"][0].update(engine="teacher"), r"\$\.evaluators\[0\]\.engine: 'teacher'"),
    (lambda a: a["pool"].update(cluster_layuot="x"), r"unknown field `cluster_layuot`"),
    (lambda a: a.update(engines={}), r"\$\.engines: at least one engine"),
    (lambda a: a.update(evaluators=[]), r"\$\.evaluators: at least one evaluator"),
    (lambda a: a["evaluators"][3].update(teacher="expert"), r"\$\.evaluators\[3\]\.teacher: 'expert' is not one of"),
    (lambda a: a["evaluators"][0].update(teacher="student"),
     r"\$\.evaluators\[0\]\.teacher: env 'arithmetic' has no DAgger agent; DAgger runs on \['math', 'swe'\]"),
])
def test_a_bad_recipe_gets_one_error_naming_the_path(mutate, message):
    args = yaml.safe_load(yaml.safe_dump(LOCAL))
    mutate(args)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(args, source="x.yaml")


def test_serve_run_without_gpus_gets_a_clear_error_before_anything_deploys(monkeypatch):
    import ray

    from rayapp.actors.app import check_live_gpus

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(RecipeError, match=r"hold GPU fractions, but this Ray cluster has no GPUs.*--num-gpus"):
        check_live_gpus(parse_recipe(LOCAL), "rollout.yaml")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 4.0})
    check_live_gpus(parse_recipe(LOCAL), "rollout.yaml")


def test_filter_step_keeps_survivors_and_counts_every_drop():
    from rayapp.actors.manager import filter_step
    from rayapp.actors.recipe import FiltersConfig
    from rayapp.core.scheduler import RolloutResult
    from rayapp.training.filters import FinishOnlyFilter, RejectionFilter
    from rayapp.types import Sample, Status

    def s(task, score, status=Status.COMPLETED, reason="stop"):
        return Sample(task, 0, "p", reward={"score": score}, status=status, metadata={"_termination_reason": reason})

    groups = [[s("a", 1), s("a", 1)],                                   # all correct: rejected
              [s("b", 0), s("b", 0)],                                   # all wrong: rejected
              [s("c", 1), s("c", 0, Status.TRUNCATED, "max_turns")],    # mixed: finish-only drops one
              [s("d", 1), s("d", 0)]]                                   # mixed, both finished: kept
    cfg = FiltersConfig(rejection=RejectionFilter(), finish_only=FinishOnlyFilter())
    out = filter_step(RolloutResult(3, groups, {"rollout/success": 3.0}), cfg)
    assert [[x.task_id for x in g] for g in out.groups] == [["c"], ["d", "d"]]
    m = out.metrics
    assert m["filter/rejection/dropped_groups/all_correct"] == 1 and m["filter/rejection/dropped_groups/all_wrong"] == 1
    assert m["filter/rejection/dropped/all_correct"] == 2 and m["filter/finish_only/dropped/truncated"] == 1
    assert m["filter/kept_samples"] == 3 and m["rollout/success"] == 3.0
    assert (m["filter/input_groups"], m["filter/input_samples"], m["filter/kept_groups"]) == (4, 8, 2)


def test_a_recipe_takes_a_dagger_schedule_and_filters():
    args = yaml.safe_load(yaml.safe_dump(LOCAL))
    args["dagger"] = {"beta_schedule": "cosine", "beta_start": 1.0, "beta_end": 0.1, "decay_iters": 3}
    args["filters"] = {"rejection": {"drop_all_wrong": True}, "finish_only": {"whole_group": False}}
    cfg = parse_recipe(args)
    assert cfg.dagger.beta(3) == pytest.approx(0.1) and cfg.filters.rejection.drop_all_wrong
    args["filters"]["rejection"]["drop_al_wrong"] = True
    with pytest.raises(RecipeError, match="drop_al_wrong"):
        parse_recipe(args)


def test_stacx_dagger_env_concurrency_sets_the_ceiling_of_swe_dagger_evaluators_only():
    args = yaml.safe_load(yaml.safe_dump(LOCAL))
    args["engines"]["teacher"] = args["engines"]["student"]
    args["evaluators"][3]["teacher"] = "teacher"  # swe becomes a DAgger evaluator
    args["evaluators"][1]["teacher"] = "teacher"  # math too: not the SWE recipe's variable's business
    cfg = parse_recipe(args)
    assert apply_env(cfg, {}) is cfg
    out = apply_env(cfg, {"STACX_DAGGER_ENV_CONCURRENCY": "7"})
    assert [e.resource.concurrency for e in out.evaluators] == [3, 3, 3, 7]
    assert out.evaluators[3].resource.cpu == cfg.evaluators[3].resource.cpu
    for bad in ("0", "four", "2.5"):
        with pytest.raises(RecipeError, match=f"STACX_DAGGER_ENV_CONCURRENCY='{bad}': expected an integer >= 1"):
            apply_env(cfg, {"STACX_DAGGER_ENV_CONCURRENCY": bad})


def test_the_demo_finds_and_stops_exactly_its_own_cluster_processes(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rayapp.cli import ray_processes, stop_cluster

    mine, other = tmp_path / "rayapp-x-12", tmp_path / "rayapp-x-123"
    pad = "p" * 300  # the folder sits far past any terminal width in the command line
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", pad, f"--temp-dir={d}/s"])
             for d in (mine, other)]
    monkeypatch.setenv("COLUMNS", "40")  # as pytest sets it: ps must still see whole command lines
    try:
        assert ray_processes(mine) == [procs[0].pid]  # not the one whose folder only starts the same
        assert stop_cluster(mine, grace_s=5) == []
        assert procs[0].wait(timeout=10) is not None and procs[1].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
