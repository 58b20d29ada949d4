"""The mini-SWE environment: every shipped repository fails exactly its failing test and passes with
its gold patch, run through a real sandbox; loading validates; the source is seeded and cycles."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from rayapp.core.termination import SandboxError
from rayapp.envs.datasets.rows import DatasetError
from rayapp.envs.sandboxes.base import SandboxLimits
from rayapp.envs.sandboxes.local import LocalProcessSandbox
from rayapp.envs.swe import (
    REPOS_DIR,
    load_repos,
    load_swe_tasks,
    parse_unittest,
    prepare_repo,
    repo_names,
    verify_swe,
)

REPOS = repo_names()
LIMITS = SandboxLimits(wall_seconds=30.0, cpu_seconds=20)


def make_sandbox():
    return LocalProcessSandbox(LIMITS, name="swe-test")


def run(coro):
    return asyncio.run(coro)


async def _files_in(sandbox) -> set[str]:
    res = await sandbox.exec("find . -type f -not -path '*/__pycache__/*' | sed 's|^\\./||'")
    assert res.ok, res.stderr
    return set(res.stdout.split())


# ---------------------------------------------------------------------------------------------- the repos


def test_ships_a_handful_of_repos():
    assert 5 <= len(REPOS) <= 8
    tasks = load_swe_tasks(task_type="swe-x", n_samples=3)
    assert [t.label["repo"] for t in tasks] == REPOS
    assert len({t.task_id for t in tasks}) == len(tasks)
    for task, repo in zip(tasks, load_repos(), strict=True):
        assert task.config.task_type == "swe-x" and task.config.n_samples == 3
        assert task.label == {"repo": repo.name, "test_command": repo.task.test_command,
                              "failing_test": repo.task.failing_test}
        assert repo.task.issue in task.prompt
        for tool in ("bash", "read_file", "write_file"):
            assert tool in task.prompt
        for path in repo.files:
            assert path in task.prompt  # the layout listing
        assert "task.json" not in task.prompt and "task.json" not in repo.files
        for fixed in repo.task.gold_patch.values():
            assert fixed not in task.prompt


@pytest.mark.parametrize("name", REPOS)
def test_repo_fails_as_shipped_and_passes_with_gold_patch(name):
    repo = next(r for r in load_repos() if r.name == name)
    only_failing = f"python3 -m unittest -q {repo.task.failing_test}"

    async def scenario():
        sandbox = make_sandbox()
        try:
            written = await prepare_repo(sandbox, name)
            assert set(written) == set(repo.files)
            files = await _files_in(sandbox)
            assert files == set(repo.files)  # never task.json, so never the gold patch
            for path, fixed in repo.task.gold_patch.items():
                assert await sandbox.read_file(path) != fixed

            shipped = await sandbox.exec(repo.task.test_command)
            report = parse_unittest(shipped.stderr)
            assert shipped.exit_code != 0 and not report.ok
            assert report.failed_ids == (repo.task.failing_test,), shipped.stderr  # exactly that test fails
            assert report.ran is not None and report.ran >= 3
            assert not (await sandbox.exec(only_failing)).ok
            assert await verify_swe(sandbox, {"repo": name}) == {
                "score": 0.0, "tests_passed": float(report.ran - 1), "tests_failed": 1.0}

            for path, fixed in repo.task.gold_patch.items():
                await sandbox.write_file(path, fixed)
            fixed_run = await sandbox.exec(only_failing)
            assert fixed_run.ok, fixed_run.stderr
            label = load_swe_tasks()[REPOS.index(name)].label
            assert await verify_swe(sandbox, label) == {
                "score": 1.0, "tests_passed": float(report.ran), "tests_failed": 0.0}
        finally:
            await sandbox.close()

    run(scenario())


# ---------------------------------------------------------------------------------------------- the verifier


def test_verify_scores_zero_for_tampered_broken_or_slow_runs():
    repo = load_repos()[0]
    label = {"repo": repo.name, "test_command": repo.task.test_command}
    test_file = next(p for p in repo.files if p.startswith("tests/test_"))
    source_file = next(iter(repo.task.gold_patch))

    async def scenario():
        sandbox = make_sandbox()
        try:
            await prepare_repo(sandbox, repo.name)
            # Gutting the tests does not pass: the shipped tests are put back before the run.
            await sandbox.write_file(test_file, "import unittest\n")
            await sandbox.write_file("tests/test_extra.py", "import sys\nsys.exit(0)\n")
            assert (await verify_swe(sandbox, label))["score"] == 0.0
            assert await sandbox.read_file(test_file) == repo.files[test_file]
            assert "tests/test_extra.py" not in await _files_in(sandbox)
            # A source file that does not even import: every test errors, nothing raises.
            await sandbox.write_file(source_file, "def broken(:\n")
            broken = await verify_swe(sandbox, label)
            assert broken["score"] == 0.0 and broken["tests_failed"] >= 1
            # A command that crashes or runs past its time: score 0, no exception.
            assert await verify_swe(sandbox, {**label, "test_command": "exit 3"}) == {
                "score": 0.0, "tests_passed": 0.0, "tests_failed": 0.0}
            slow = await verify_swe(sandbox, {**label, "test_command": "sleep 20"}, timeout_s=0.5)
            assert slow["score"] == 0.0
            # Something in the way of the restore (the test folder made undeletable): score 0.
            await sandbox.exec("mkdir -p tests/locked/inner && chmod 0500 tests/locked")
            if not (await sandbox.exec("rm -rf tests/locked/inner")).ok:  # root would delete it anyway
                assert (await verify_swe(sandbox, label))["score"] == 0.0
        finally:
            await sandbox.close()
        # A sandbox fault is not a wrong answer: it propagates for the evaluator to classify.
        with pytest.raises(SandboxError):
            await verify_swe(sandbox, label)

    run(scenario())


def test_verify_rejects_unknown_repo_labels():
    async def scenario():
        sandbox = make_sandbox()
        try:
            with pytest.raises(ValueError, match="unknown swe repo"):
                await verify_swe(sandbox, {"repo": "../../etc"})
            with pytest.raises(ValueError, match="unknown swe repo"):
                await prepare_repo(sandbox, "nope")
        finally:
            await sandbox.close()

    run(scenario())


def test_parse_unittest_outputs():
    out = ("..F.s\n======\nFAIL: test_b (pkg.mod.Case.test_b)\n----\nTraceback ...\n"
           "ERROR: test_c (pkg.mod.Other)\n----\nRan 5 tests in 0.003s\n\nFAILED (failures=1, errors=1, skipped=1)\n")
    report = parse_unittest(out)
    assert (report.ran, report.ok, report.failed, report.passed) == (5, False, 2, 2)
    assert report.failed_ids == ("pkg.mod.Case.test_b", "pkg.mod.Other.test_c")  # 3.11+ and older formats
    ok = parse_unittest("....\n------\nRan 4 tests in 0.001s\n\nOK (expected failures=1)\n")
    assert (ok.ran, ok.ok, ok.failed, ok.passed) == (4, True, 0, 3)
    assert parse_unittest("Traceback (most recent call last):\n  ...\nSyntaxError: bad\n").ran is None
    assert parse_unittest("\nRan 0 tests in 0.000s\n\nNO TESTS RAN\n").ran == 0


# ---------------------------------------------------------------------------------------------- loading


@pytest.fixture
def repos_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repos"
    shutil.copytree(REPOS_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edit_task(root: Path, name: str, **changes) -> Path:
    path = root / name / "task.json"
    task = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del task[key]
        else:
            task[key] = value
    path.write_text(json.dumps(task))
    return path


@pytest.mark.parametrize(("changes", "field", "why"), [
    ({"failing_test": 5}, "$.failing_test", "expected str"),
    ({"issue": None}, "$.issue", "missing required field"),
    ({"issue": ""}, "$.issue", "length"),
    ({"gold_patch": {"../escape.py": "x"}}, "$.gold_patch.../escape.py", "relative path"),
    ({"gold_patch": {"tests/test_x.py": "x"}}, "$.gold_patch.tests/test_x.py", "tests"),
    ({"failing_test": "tests.test_nothing.Case.test_x"}, "$.failing_test", "no test module"),
    ({"surprise": 1}, "$", "surprise"),
])
def test_bad_task_json_is_one_error_naming_repo_file_and_field(repos_copy, changes, field, why):
    name = REPOS[-1]
    path = _edit_task(repos_copy, name, **changes)
    with pytest.raises(DatasetError) as err:
        load_swe_tasks(root=repos_copy)
    message = str(err.value)
    assert f"swe repo {name!r}" in message and str(path) in message
    assert f": {field}:" in message and why in message


def test_malformed_json_and_duplicate_ids(repos_copy):
    first, second = REPOS[0], REPOS[1]
    (repos_copy / first / "task.json").write_text("{not json")
    with pytest.raises(DatasetError, match=rf"swe repo '{first}' \(.*task\.json'\): malformed JSON: "):
        load_swe_tasks(root=repos_copy)
    shutil.copy(REPOS_DIR / first / "task.json", repos_copy / first / "task.json")
    _edit_task(repos_copy, second, id=json.loads((REPOS_DIR / first / "task.json").read_text())["id"])
    with pytest.raises(DatasetError, match=rf"swe repo '{second}'.*\$\.id: duplicate value"):
        load_swe_tasks(root=repos_copy)


# ---------------------------------------------------------------------------------------------- the source


def test_swe_dataset_plugs_into_multi_data_source():
    from rayapp.envs.datasets.source import MultiDataSource
    from rayapp.envs.registry import make_dataset
    from rayapp.recipe import DatasetConfig

    source = MultiDataSource([make_dataset(DatasetConfig(env="swe", dataset_cfg={"max_turns": 8}), "swe")], seed=3)
    tasks = source.take(len(REPOS))
    assert sorted(t.label["repo"] for t in tasks) == REPOS  # one epoch: each repository once
    assert all(t.metadata["_dataset_name"] == "swe" and t.metadata["_dataset_cfg"] == {"max_turns": 8}
               for t in tasks)
