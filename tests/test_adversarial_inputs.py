"""Adversarial recipes at the door: each crafted input to ``rayapp validate`` gets exactly one clear
error line naming the file and the JSON path (or the plug-in), within 10 seconds, and changes
nothing on disk. Each case is a copy of recipes/local/rollout.yaml, mutated, in its own folder;
the checks run in-process (on a daemon thread, so a hang fails the case instead of the session;
``problems`` itself runs the recipe's plug-in code in a watched child, so even ``os._exit`` in a plug-in
is one line here), and the cases whose point is the process (a plug-in calling sys.exit, os._exit or
raising KeyboardInterrupt, a FIFO) through the CLI too."""

from __future__ import annotations

import copy
import gzip
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT
from rayapp.cli.check import problems

GOOD = ROOT / "recipes" / "local" / "rollout.yaml"
ARGS = "$.applications[0].args"
LIMIT_S = 10.0


def _doc() -> dict:
    return yaml.safe_load(GOOD.read_text())


def _args(doc: dict) -> dict:
    return doc["applications"][0]["args"]


def _module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(body)
    return name


def _gzip_bomb(path: Path) -> None:
    """256 MB of zeros in ~260 KB: one gzip member of 1 MB, repeated (a file of members is one stream)."""
    path.write_bytes(gzip.compress(bytes(1 << 20), compresslevel=9) * 256)


def _corrupt_gzip(path: Path) -> None:
    """A valid gzip header, then deflate data of an invalid block type: zlib.error, not an OSError."""
    path.write_bytes(gzip.compress(b'{"prompt": "1+1", "label": "2"}\n' * 100)[:10] + b"\xff" * 64)


# --- the cases: (id, mutate(doc, folder) -> None or raw text, the JSON path, words the reason holds) -------------

def _data_path(doc, folder, name, make):
    path = folder / name
    make(path)
    _args(doc)["data"]["arithmetic"] = {"env": "arithmetic", "path": str(path)}


def _layout_file(doc, folder, make):
    path = folder / "layout.json"
    make(path)
    _args(doc)["pool"]["cluster_layout"] = str(path)


def _source(doc, folder, body, attr="rows", name="advmod"):
    mod = _module(folder, f"{name}_{folder.name.replace('-', '_')}", body)
    _args(doc)["data"]["arithmetic"]["source"] = f"{mod}:{attr}"


def _agent(doc, folder, body, attr="make"):
    mod = _module(folder, f"advagent_{folder.name.replace('-', '_')}", body)
    _args(doc)["evaluators"][0]["agent"] = f"{mod}:{attr}"


def _second_app(doc, folder):
    """A second application of rayapp's builder in the same file, the first one fine."""
    second = copy.deepcopy(doc["applications"][0])
    second.update(name="second", route_prefix="/second")
    second["args"]["engines"]["student"]["num_replicas"] = 100000
    doc["applications"].append(second)


def _link_into_proc(doc, folder):
    (folder / "lnk").symlink_to("/proc")
    _args(doc)["scheduler"]["checkpoint_dir"] = str(folder / "lnk" / "x")


def _set(*keys_value):
    *keys, value = keys_value

    def mutate(doc, folder):
        node = _args(doc)
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value(folder) if callable(value) else value
    return mutate


def _layout(layout, budget_gpu=None, **sample):
    def mutate(doc, folder):
        args = _args(doc)
        args["pool"]["cluster_layout"] = layout
        args["evaluators"][0]["run_resource"].update(sample)
        if budget_gpu is not None:
            args["evaluators"][0]["resource"]["gpu"] = budget_gpu
    return mutate


def _all_weights_0(doc, folder):
    for dataset in _args(doc)["data"].values():
        dataset["weight"] = 0


def _raw(text):
    return lambda doc, folder: text


def _engine_options(**options):
    return _set("engines", "student", "options", options)


ARITH = f"{ARGS}.data.arithmetic"
E0 = f"{ARGS}.evaluators[0]"
SCHED = f"{ARGS}.scheduler"
BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))

CASES = [
    # crashes before
    ("corrupt-gzip", lambda d, f: _data_path(d, f, "rows.jsonl.gz", _corrupt_gzip), f"{ARITH}.path", "cannot read"),
    ("gzip-bomb", lambda d, f: _data_path(d, f, "bomb.jsonl.gz", _gzip_bomb), f"{ARITH}.path", "gzip bomb"),
    ("dev-urandom", lambda d, f: _data_path(d, f, "rand.jsonl", lambda p: p.symlink_to("/dev/urandom")),
     f"{ARITH}.path", "not a regular file"),
    ("yaml-nested-5000", _raw("a: " + "[" * 5000 + "]" * 5000 + "\n"), "$.a" + "[0]" * 63, "nested deeper"),
    ("plugin-sys-exit", lambda d, f: _source(d, f, "import sys\nsys.exit(3)\n"), f"{ARITH}.source", "sys.exit(3)"),
    # hangs before
    ("fifo-dataset", lambda d, f: _data_path(d, f, "fifo.jsonl", os.mkfifo), f"{ARITH}.path", "not a regular file"),
    ("plugin-sleeps-at-import", lambda d, f: _source(d, f, "import time\ntime.sleep(30)\n"), f"{ARITH}.source",
     "importing 'advmod_plugin_sleeps_at_import': still importing after 3 s, no module loaded"),
    # accepted before
    ("gpu-5-on-4-gpu-node", _layout({"n0": {"gpus": [0, 1, 2, 3], "cpu": 8, "memory_gb": 32}}, gpu=5),
     f"{E0}.resource", "admits no sample"),  # its budget (gpu 0.75) first
    ("gpu-5-on-4-gpu-node-with-budget", _layout({"n0": [0, 1, 2, 3]}, gpu=5, budget_gpu=10), f"{E0}.run_resource",
     "more than any node"),
    ("sample-larger-than-any-node", _layout({"n0": {"gpus": [0, 1, 2, 3], "cpu": 0.25, "memory_gb": 32}}),
     f"{E0}.run_resource", "more than any node"),
    ("budget-admits-no-sample", _set("evaluators", 0, "resource", {"gpu": 0.1, "concurrency": 3, "cpu": 1.5,
                                                                   "memory_gb": 3}), f"{E0}.resource",
     "admits no sample"),
    ("pool-num-cpus-0", _set("pool", "num_cpus", 0), f"{ARGS}.pool.num_cpus", "none would be admitted"),
    ("empty-node", _set("pool", "cluster_layout", {"n0": {"gpus": [], "cpu": 0, "memory_gb": 0}}),
     f"{ARGS}.pool.cluster_layout", "offers nothing"),
    ("n-prompts-int32-max", _set("data", "arithmetic", "n_prompts", 2147483647), f"{ARITH}.n_prompts", "<= 1000000"),
    ("num-replicas-100000", _set("engines", "student", "num_replicas", 100000),
     f"{ARGS}.engines.student.num_replicas", "<= 1024"),
    ("pool-memory-1e300", _set("pool", "memory_gb", 1e300), f"{ARGS}.pool.memory_gb", "<= 1048576"),
    ("sample-memory-1e300", _set("evaluators", 0, "run_resource", {"gpu": 0.25, "memory_gb": 1e300}),
     f"{E0}.run_resource.memory_gb", "at most"),
    ("all-weights-0", _all_weights_0,
     f"{ARGS}.data", "weight 0"),
    ("source-wrong-shape", lambda d, f: _source(d, f, "def rows():\n    return []\n"), f"{ARITH}.source",
     "expected rows(cfg"),
    ("source-builtin", _set("data", "arithmetic", "source", "builtins:len"), f"{ARITH}.source", "built-in"),
    ("duplicate-yaml-key", lambda d, f: GOOD.read_text().replace("    seed: 0\n", "    seed: 0\n        seed: 1\n"),
     f"{SCHED}.seed", "duplicate key"),
    ("http-options-typo", lambda d, f: d["http_options"].update(prot=8000), "$.http_options", "unknown field \"prot\""),
    ("engine-option-typo", _engine_options(max_concurency=4), f"{ARGS}.engines.student.options",
     "did you mean 'max_concurrency'"),
    ("batching-os-system", _set("scheduler", "batching", "os:system"), f"{SCHED}.batching", "built-in"),
    ("batching-wrong-shape", lambda d, f: _args(d)["scheduler"].update(
        batching=_module(f, f"advbatch_{f.name.replace('-', '_')}", "def b(tasks):\n    return []\n") + ":b"),
     f"{SCHED}.batching", "expected strategy(tasks"),
    ("checkpoint-dir-proc", _set("scheduler", "checkpoint_dir", "/proc/rayapp"), f"{SCHED}.checkpoint_dir", "/proc"),
    ("checkpoint-dir-etc-passwd", _set("scheduler", "checkpoint_dir", "/etc/passwd"), f"{SCHED}.checkpoint_dir",
     "is a file"),
    ("checkpoint-dir-under-file", _set("scheduler", "checkpoint_dir", "/etc/passwd/ckpt"), f"{SCHED}.checkpoint_dir",
     "is a file"),
    ("checkpoint-dir-empty", _set("scheduler", "checkpoint_dir", ""), f"{SCHED}.checkpoint_dir", "folder path"),
    ("save-eval-details-proc", _set("scheduler", "save_eval_details", "/proc"), f"{SCHED}.save_eval_details",
     "/proc"),
    ("save-eval-details-empty", _set("scheduler", "save_eval_details", "  "), f"{SCHED}.save_eval_details",
     "folder path"),
    ("trajectory-dir-dev", _set("scheduler", "trajectory_dir", "/dev/shm/x"), f"{SCHED}.trajectory_dir", "/dev"),
    ("model-path-missing", _engine_options(model_path="/nonexistent/model"),
     f"{ARGS}.engines.student.options.model_path", "not a local model folder"),
    ("yaml-billion-laughs", _raw(BILLION_LAUGHS), "$.", "aliases"),
    ("yaml-recursive-anchor", _raw("a: &a [1, *a]\n"), "$.a[1]", "recursive"),
    # unclear before
    ("dagger-decay-iters-negative", _set("dagger", {"decay_iters": -2}), f"{ARGS}.dagger.decay_iters",
     "must be an integer >= 0, got -2"),
    ("dagger-beta-end-above-start", _set("dagger", {"beta_start": 0.5, "beta_end": 0.9}),
     f"{ARGS}.dagger.beta_end", "dagger.beta_start"),
    ("serve-config-without-applications", _raw("proxy_location: HeadOnly\nhttp_options: {port: 8000}\n"), "$:",
     'needs "applications"'),
    # more
    ("empty-file", _raw(""), "", "expected an object"),
    ("binary-file", lambda d, f: b"\x89PNG\r\n\x1a\n\0\0\xff\xfe" * 8, "", "not UTF-8"),
    ("nul-in-dataset-path", _set("data", "arithmetic", {"env": "arithmetic", "path": "a\0b.jsonl"}),
     f"{ARITH}.path", "cannot read"),
    ("unicode-dataset-path", _set("data", "arithmetic", {"env": "arithmetic", "path": "données/ü\u202e.jsonl"}),
     f"{ARITH}.path", "No such file"),
    ("dataset-path-directory", lambda d, f: _data_path(d, f, "dir.jsonl", Path.mkdir), f"{ARITH}.path",
     "Is a directory"),
    ("dataset-symlink-loop", lambda d, f: _data_path(d, f, "loop.jsonl", lambda p: p.symlink_to(p)),
     f"{ARITH}.path", "cannot read"),
    ("dataset-deep-json-row", lambda d, f: _data_path(d, f, "deep.jsonl", lambda p: p.write_text("[" * 100000 + "\n")),
     f"{ARITH}.path", "line 1"),
    ("huge-integer", _set("scheduler", "rollout_batch_size", 10**30), f"{SCHED}.rollout_batch_size", "expected int"),
    ("integer-of-5000-digits", _raw("engines: {student: {num_replicas: " + "9" * 5000 + "}}\n"), "",
     "malformed YAML: Exceeds the limit"),
    ("negative-timeout", _set("engines", "student", "request_timeout_s", -1),
     f"{ARGS}.engines.student.request_timeout_s", "> 0"),
    ("nan-timeout", _set("evaluators", 0, "eval_timeout_s", float("nan")), f"{E0}.eval_timeout_s", "nan"),
    ("inf-memory", _set("evaluators", 0, "resource", {"memory_gb": float("inf")}), f"{E0}.resource.memory_gb",
     "inf"),
    ("yaml-key-is-a-list", _raw("? [a, b]\n: 1\n"), "$", "collection"),
    ("yaml-two-documents", _raw("a: 1\n---\nb: 2\n"), "", "single document"),
    ("top-level-list", _raw("- 1\n- 2\n"), "$", "expected an object"),
    ("too-many-aliases", _raw("x: &x 1\nl: [" + ", ".join(["*x"] * 100) + "]\n"), "$.l[64]", "aliases"),
    ("recipe-too-large", _raw("# " + "x" * (2 << 20) + "\n"), "", "bytes"),
    ("layout-file-too-small", lambda d, f: _layout_file(d, f, lambda p: p.write_text(
        '{"n0": {"gpus": [0, 1, 2, 3], "cpu": 0.25, "memory_gb": 32}}')), f"{E0}.run_resource", "more than any node"),
    ("layout-file-fifo", lambda d, f: _layout_file(d, f, os.mkfifo), f"{ARGS}.pool.cluster_layout",
     "not a regular file"),
    ("tool-builtin", _set("evaluators", 1, "tools", ["builtins:print"]), f"{ARGS}.evaluators[1].tools[0]",
     "built-in"),
    # found by a later audit: plug-in calls at validate (hangs and silent exits), paths read as text,
    # unbounded layout nodes, standard-library strategies, a second app, the HTTP token
    ("plugin-rows-sleeps", lambda d, f: _source(d, f, "import time\ndef rows(cfg):\n    time.sleep(60)\n"),
     f"{ARITH}.source", "its rows(cfg) still running after 5 s, mostly idle"),
    ("plugin-rows-endless", lambda d, f: _source(d, f, "from rayapp.types import Task, TaskConfig\ndef rows(cfg):\n"
                                                       "    i = 0\n    while True:\n        i += 1\n"
                                                       "        yield Task(f't{i}', 'p', TaskConfig('arithmetic'))\n"),
     f"{ARITH}.source", "its rows(cfg)"),  # still running after 5 s, or more than 1000000 rows: whichever first
    ("plugin-rows-sys-exit", lambda d, f: _source(d, f, "import sys\ndef rows(cfg):\n    sys.exit(4)\n"),
     f"{ARITH}.source", "its rows(cfg) called sys.exit(4)"),
    ("plugin-rows-keyboard-interrupt", lambda d, f: _source(d, f, "def rows(cfg):\n    raise KeyboardInterrupt\n"),
     f"{ARITH}.source", "its rows(cfg) raised KeyboardInterrupt"),
    ("plugin-import-keyboard-interrupt", lambda d, f: _source(d, f, "raise KeyboardInterrupt\n"), f"{ARITH}.source",
     "raised KeyboardInterrupt"),
    ("plugin-os-exit-at-import", lambda d, f: _source(d, f, "import os\nos._exit(3)\n"), f"{ARITH}.source",
     "ended the process (exit status 3)"),
    ("agent-factory-sleeps", lambda d, f: _agent(d, f, "import time\ndef make(deps):\n    time.sleep(60)\n"),
     f"{E0}.agent", "building it with AgentDeps still running after 5 s, mostly idle"),
    ("agent-factory-sys-exit", lambda d, f: _agent(d, f, "import sys\ndef make(deps):\n    sys.exit(5)\n"),
     f"{E0}.agent", "building it with AgentDeps called sys.exit(5)"),
    ("agent-factory-os-exit", lambda d, f: _agent(d, f, "import os\ndef make(deps):\n    os._exit(6)\n"),
     f"{E0}.agent", "building it with AgentDeps ended the process (exit status 6)"),
    ("checkpoint-dir-dotdot-proc", _set("scheduler", "checkpoint_dir", "/tmp/../proc/x"), f"{SCHED}.checkpoint_dir",
     "(that is '/proc/x')"),
    ("checkpoint-dir-link-to-proc", _link_into_proc, f"{SCHED}.checkpoint_dir", "(that is '/proc/x')"),
    ("checkpoint-dir-etc", _set("scheduler", "checkpoint_dir", "/etc"), f"{SCHED}.checkpoint_dir", "system folder"),
    ("layout-node-memory-1e300", _set("pool", "cluster_layout", {"n0": {"gpus": [0, 1, 2, 3], "cpu": 8,
                                                                        "memory_gb": 1e300}}),
     f"{ARGS}.pool.cluster_layout.n0.memory_gb", "at most 1.04858e+06"),
    ("layout-node-cpu-1e300", _set("pool", "cluster_layout", {"n0": {"gpus": [0, 1, 2, 3], "cpu": 1e300}}),
     f"{ARGS}.pool.cluster_layout.n0.cpu", "at most 65536"),
    ("batching-os-popen", _set("scheduler", "batching", "os:popen"), f"{SCHED}.batching", "standard library"),
    ("batching-subprocess-call", _set("scheduler", "batching", "subprocess:call"), f"{SCHED}.batching",
     "standard library"),
    ("batching-shutil-rmtree", _set("scheduler", "batching", "shutil:rmtree"), f"{SCHED}.batching",
     "standard library"),
    ("second-app-num-replicas-100000", _second_app, "$.applications[1].args.engines.student.num_replicas", "<= 1024"),
    ("runtime-env-short-token", lambda d, f: d["applications"][0].update(
        runtime_env={"env_vars": {"RAYAPP_HTTP_TOKEN": "short"}}),
     "$.applications[0].runtime_env.env_vars.RAYAPP_HTTP_TOKEN", "16 to 4096 characters"),
]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _in_thread(fn, *args):
    """``fn(*args)`` on a daemon thread, waited on for LIMIT_S: (result, seconds); a hang fails, never blocks."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn(*args)), daemon=True)
    start = time.monotonic()
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"no answer within {LIMIT_S} s"
    return box["result"], time.monotonic() - start


def _make(case_id, mutate, folder: Path) -> Path:
    folder.mkdir()
    doc = _doc()
    _args(doc)["scheduler"]["save_eval_details"] = str(folder / "details")  # must not be created
    out = mutate(doc, folder)
    recipe = folder / "recipe.yaml"
    if isinstance(out, bytes):
        recipe.write_bytes(out)
    else:
        recipe.write_text(out if isinstance(out, str) else yaml.safe_dump(doc, sort_keys=False))
    return recipe


@pytest.fixture(autouse=True)
def _plugin_timeout(monkeypatch):
    """Each plug-in call given 3 s (and the watch's 2 s grace): a hang is found within LIMIT_S."""
    monkeypatch.setenv("RAYAPP_PLUGIN_TIMEOUT_S", "3")


@pytest.fixture(scope="module", autouse=True)
def _serve_schema_imported():
    """Serve's schema imported once up front: its first import (seconds) is no input's cost."""
    import ray.serve.schema  # noqa: F401


def test_there_are_enough_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("case_id", "mutate", "at", "words"), CASES, ids=[c[0] for c in CASES])
def test_each_crafted_recipe_is_one_clear_error_within_seconds(case_id, mutate, at, words, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / case_id))
    recipe = _make(case_id, mutate, tmp_path / case_id)
    before = _snapshot(tmp_path)
    found, seconds = _in_thread(problems, recipe)
    assert len(found) == 1, found
    line = found[0]
    assert line.startswith(f'recipe "{recipe}": {at}'), line
    assert words in line, line
    assert line.count(str(tmp_path / case_id)) <= 2, line  # the recipe, and at most one file it names: once
    assert "Traceback" not in line and "\n" not in line
    assert seconds < LIMIT_S
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / case_id / "details").exists()


def test_the_shipped_recipes_still_validate():
    for recipe in sorted((ROOT / "recipes").glob("*/rollout.yaml")):
        assert problems(recipe) == [], recipe


CLI_CASES = ["plugin-sys-exit", "fifo-dataset", "plugin-rows-sys-exit", "plugin-rows-keyboard-interrupt",
             "plugin-import-keyboard-interrupt", "plugin-os-exit-at-import", "agent-factory-sys-exit"]


def _validate(recipe: Path, env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rayapp.cli", "validate", str(recipe)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def cli_start_s() -> float:
    """Seconds the CLI takes to validate the shipped recipe here and now: starting Python on a loaded
    2-core machine alone can take seconds, which no input should be blamed for."""
    proc, seconds = _validate(GOOD, {**os.environ, **LOCAL_ENV, "PYTHONPATH": str(ROOT)}, 120)
    assert proc.returncode == 0, proc.stderr
    return seconds


@pytest.mark.parametrize("case_id", CLI_CASES)
def test_the_cli_exits_2_with_one_line_within_seconds(case_id, tmp_path, cli_start_s):
    _, mutate, at, words = next(c for c in CASES if c[0] == case_id)
    recipe = _make(case_id, mutate, tmp_path / case_id)
    before = _snapshot(tmp_path)
    env = {**os.environ, **LOCAL_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / case_id}"}
    proc, seconds = _validate(recipe, env, cli_start_s + LIMIT_S)
    assert seconds < cli_start_s + LIMIT_S
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f'recipe "{recipe}": {at}') and words in lines[0], proc.stderr
    assert _snapshot(tmp_path) == before


def test_the_hf_option_names_are_the_backend_s():
    import inspect

    from rayapp.inference.hf import HFBackend
    from rayapp.recipe.limits import HF_OPTIONS

    assert tuple(inspect.signature(HFBackend.__init__).parameters)[1:] == HF_OPTIONS


def test_a_gzip_file_of_ordinary_rows_still_reads(tmp_path):
    from rayapp.envs.datasets.files import FieldMap, load_file

    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "1+1", "label": "2"}\n' * 1000))
    assert len(load_file(path, "d", FieldMap(), task_type="arithmetic")) == 1000
