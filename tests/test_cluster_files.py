"""Static checks of the files that run rayapp on real clusters: recipes, layouts, the Ray cluster
launcher YAML and the KubeRay RayService. None of them can run here (no GPU, no cloud, no Kubernetes),
so these tests hold them to what can be checked without a cluster: they parse, they validate against
the schemas that will read them, and the copies that must agree do agree. No Ray is started."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest
import yaml

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool, budget_tokens
from rayapp.envs.registry import get_env
from rayapp.recipe import parse_recipe
from rayapp.types import EvaluatorSpec, Resource, StoppingCriteria

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = sorted((ROOT / "cluster" / "layouts").glob("*.json"))
SERVE_YAMLS = sorted(p for p in (ROOT / "recipes").rglob("*.y*ml")
                     if "applications" in (yaml.safe_load(p.read_text()) or {}))
RECIPES = sorted((ROOT / "recipes").glob("*/rollout.yaml"))
SWE = ROOT / "recipes" / "swe_dagger" / "rollout.yaml"
LAUNCHER = ROOT / "cluster" / "ray-cluster.yaml"
KUBERAY = ROOT / "cluster" / "kuberay-rayservice.yaml"
NODE_LABEL = "rayapp.io/node"  # rayapp.actors.pool_service.NODE_LABEL, without importing ray


@pytest.fixture(autouse=True)
def example_agents_importable(monkeypatch):
    """recipes/train_grpo/gateway.yaml names examples/openai_agent's agent, which its driver puts on the
    manager's PYTHONPATH (recipes/train_grpo.py --agent gateway): here, on this process's path."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "openai_agent"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _args(path: Path) -> dict:
    (app,) = _load(path)["applications"]
    return app["args"]


def _kuberay_docs() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]
    return {d["kind"]: d for d in docs}


# -- layouts ---------------------------------------------------------------------------------------


def test_the_layout_examples_exist():
    names = {p.name for p in LAYOUTS}
    assert {"swe_4gpu.json", "shorthand.json", "two_node.json", "swe_cluster.json"} <= names


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_every_layout_file_parses(path):
    layout = parse_cluster_layout(path, 96, 384)
    assert layout
    for node in layout.values():
        assert node.gpus or node.cpu or node.memory_gb


def test_layout_forms_from_the_spec():
    layouts = ROOT / "cluster" / "layouts"
    full = parse_cluster_layout(layouts / "swe_4gpu.json", 0, 0)
    assert json.loads((layouts / "swe_4gpu.json").read_text()) == {
        "127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 96, "memory_gb": 384}}
    assert (full["127.0.0.1"].cpu, full["127.0.0.1"].memory_gb) == (96, 384)
    # The shorthand takes cpu and memory from --env-num-cpus / --env-memory-gb.
    short = parse_cluster_layout(layouts / "shorthand.json", 12, 34)
    assert short["127.0.0.1"].gpus == (0, 1, 2, 3)
    assert (short["127.0.0.1"].cpu, short["127.0.0.1"].memory_gb) == (12, 34)
    two = parse_cluster_layout(layouts / "two_node.json", 8, 16)
    assert len(two) == 2
    for name in two:
        ipaddress.ip_address(name)  # named by IP


# -- recipes ---------------------------------------------------------------------------------------


def test_both_recipes_are_here():
    assert {p.parent.name for p in RECIPES} >= {"local", "swe_dagger"}


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_recipe_parses(path):
    recipe = parse_recipe(_args(path), source=_rel(path))
    for ev in recipe.evaluators:
        get_env(ev.env)  # an env the registry knows today
    for ds in [*recipe.data.values(), *recipe.eval.values()]:
        get_env(ds.env)


@pytest.mark.parametrize("path", SERVE_YAMLS, ids=_rel)
def test_serve_yaml_listens_on_loopback_only(path):
    assert _load(path)["http_options"]["host"] == "127.0.0.1"


def test_serve_yamls_found():
    assert set(RECIPES) <= set(SERVE_YAMLS)


@pytest.mark.parametrize("path", SERVE_YAMLS, ids=_rel)
def test_serve_yaml_validates_and_builds_without_ray(path):
    import ray
    from ray.serve.schema import ServeDeploySchema

    from rayapp.actors.app import build_app

    config = _load(path)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert (module, attr) == ("rayapp.actors.app", "build_app")
    assert getattr(__import__(module, fromlist=[attr]), attr) is build_app
    # Building checks each deployment's options (an engine replica must fit its first bundle)
    # without deploying anything.
    assert build_app(app["args"]) is not None
    assert not ray.is_initialized()


def test_swe_recipe_is_the_spec_example():
    recipe = parse_recipe(_args(SWE), source=_rel(SWE))
    assert {name: e.backend for name, e in recipe.engines.items()} == {"student": "sglang", "teacher": "sglang"}
    (ev,) = recipe.evaluators
    assert ev.resource == Resource(gpu=0, concurrency=4, cpu=96, memory_gb=320)
    assert ev.run_resource == ev.eval_resource == Resource(gpu=0, concurrency=1, cpu=4, memory_gb=16)
    assert ev.batch_size == 1
    assert ev.default_stopping == StoppingCriteria(max_turns=100, max_context_len=65536)
    # tasks reach this spec, not the fallback: the swe env's rows carry task_type "swe"
    assert all((d.task_type or d.env) == ev.evaluator_id for d in [*recipe.data.values(), *recipe.eval.values()])
    for e in recipe.engines.values():
        assert e.num_gpus == e.options["tp_size"]  # the replica sees exactly its TP ranks' GPUs


def test_swe_recipe_layout_admits_its_biggest_batch():
    """The scheduler's start-up deadlock check, done ahead of time on the recipe's own layout."""
    recipe = parse_recipe(_args(SWE), source=_rel(SWE))
    path = recipe.pool.cluster_layout
    assert isinstance(path, str) and not Path(path).is_absolute()
    layout = parse_cluster_layout(ROOT / path, recipe.pool.num_cpus, recipe.pool.memory_gb)
    (ev,) = recipe.evaluators
    spec = EvaluatorSpec(ev.evaluator_id, None, ev.resource, ev.run_resource, ev.eval_resource, ev.batch_size)
    per_prompt = max(d.n_samples_per_prompt or 1 for d in recipe.data.values())
    biggest = ev.batch_size * max(per_prompt, recipe.scheduler.n_samples_per_eval_prompt)
    needed = min(budget_tokens(spec.resource, spec.sample_resource), biggest)
    assert PlacementPool(layout).capacity_for(spec.sample_resource) >= needed >= 1


# -- the Ray cluster launcher ----------------------------------------------------------------------


def test_launcher_yaml_names_its_head_type():
    config = _load(LAUNCHER)
    assert config["head_node_type"] in config["available_node_types"]
    assert sum(t.get("min_workers", 0) for t in config["available_node_types"].values()) <= config["max_workers"]


def test_launcher_yaml_validates_against_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(_load(LAUNCHER), schema)


def test_launcher_labels_the_node_the_swe_layout_names():
    config = _load(LAUNCHER)
    layout = parse_cluster_layout(ROOT / _args(SWE)["pool"]["cluster_layout"], 0, 0)
    commands = " ".join(config["worker_start_ray_commands"])
    labels = {word.split("=", 2)[2] for word in commands.split() if word.startswith(f"--labels={NODE_LABEL}=")}
    assert set(layout) <= labels
    # The mounted recipes and layouts are the ones in this repository.
    for local in config["file_mounts"].values():
        if local.startswith("./"):
            assert (ROOT / local).is_dir(), local


# -- KubeRay ---------------------------------------------------------------------------------------


def test_kuberay_serve_config_is_the_swe_recipe():
    service = _kuberay_docs()["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == _load(SWE)


def test_kuberay_cluster_has_a_head_and_a_gpu_group_for_the_layout():
    docs = _kuberay_docs()
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    (worker,) = gpu_group["template"]["spec"]["containers"]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == 4
    assert "rayStartParams" in gpu_group
    # The ConfigMap carries the very layout the recipe names, and the group label resolves its node.
    layout_name = Path(_args(SWE)["pool"]["cluster_layout"]).name
    shipped = json.loads(docs["ConfigMap"]["data"][layout_name])
    assert shipped == json.loads((ROOT / "cluster" / "layouts" / layout_name).read_text())
    assert set(shipped) == {gpu_group["labels"][NODE_LABEL]}


# -- the tokenizer comes from the engine ------------------------------------------------------------


def test_an_engine_carries_its_tokenizer_files_but_not_its_weights(model_dir, tmp_path):
    from rayapp.inference.tiny_model import load_tokenizer
    from rayapp.inference.tokenizer_files import WEIGHT_SUFFIXES, cache_tokenizer_files, read_tokenizer_files

    files = read_tokenizer_files(model_dir)
    assert "tokenizer_config.json" in files and not any(Path(n).suffix in WEIGHT_SUFFIXES for n in files)
    assert any(p.suffix in WEIGHT_SUFFIXES for p in model_dir.iterdir())  # there were weights to leave out
    folder = cache_tokenizer_files(files, tmp_path / "cache")
    assert cache_tokenizer_files(files, tmp_path / "cache") == folder  # once per content
    here, there = load_tokenizer(model_dir), load_tokenizer(folder)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert (there.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            == here.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert (there.eos_token_id, there.pad_token_id) == (here.eos_token_id, here.pad_token_id)
    assert read_tokenizer_files(tmp_path / "no-such-model") == {}


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "", "a/b/c/d"])
def test_tokenizer_file_names_that_leave_the_folder_are_refused(tmp_path, name):
    from rayapp.inference.tokenizer_files import TokenizerFilesError, cache_tokenizer_files

    with pytest.raises(TokenizerFilesError, match="not a plain relative path"):
        cache_tokenizer_files({"tokenizer.json": b"{}", name: b"x"}, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _engine_handle(model_dir, reported_path):
    """A stand-in for an engine deployment's handle: its info and its tokenizer files, calls counted."""
    from rayapp.inference.tokenizer_files import read_tokenizer_files

    class Method:
        def __init__(self, fn):
            self.fn, self.calls = fn, 0

        def remote(self):
            self.calls += 1

            async def call():
                return self.fn()

            return call()

    class Handle:
        info = Method(lambda: {"backend": "sglang", "tokenizer_path": reported_path})
        tokenizer_files = Method(lambda: read_tokenizer_files(model_dir))

    return Handle


def test_the_manager_loads_the_engines_tokenizer_where_the_model_is_not(model_dir, tmp_path, monkeypatch):
    """The manager asks the engine for its tokenizer files: the model path it reports need not exist on
    the manager's node (the cluster files mount models on GPU workers only)."""
    import asyncio

    from rayapp.actors.engine import EngineClient

    Handle = _engine_handle(model_dir, "/mnt/models/student")  # what the engine replica on the GPU node answers
    monkeypatch.setenv("RAYAPP_CACHE", str(tmp_path / "cache"))
    client = EngineClient(Handle(), "student")
    info = asyncio.run(client.info())
    assert info["engine_tokenizer_path"] == "/mnt/models/student"
    assert Path(info["tokenizer_path"]).parent == tmp_path / "cache" / "tokenizers"
    from rayapp.inference.tiny_model import load_tokenizer

    assert load_tokenizer(info["tokenizer_path"]).get_vocab() == load_tokenizer(model_dir).get_vocab()
    asyncio.run(client.info())
    assert (Handle.info.calls, Handle.tokenizer_files.calls) == (1, 1)  # asked once per client


def test_the_cache_is_absolute_and_never_inside_rayapp_s_own_folder(model_dir, tmp_path, monkeypatch):
    """A replica reads ``RAYAPP_CACHE`` from its own environment: a relative value (read against whatever
    working directory the replica has) and one inside the package (a test once set it to the shipped
    model's grandparent, and the manager wrote ``rayapp/tokenizers/<digest>/`` into the checkout) are
    refused; unset, it is ~/.cache/rayapp of the process's home."""
    import asyncio

    import rayapp
    from rayapp.actors.engine import EngineClient
    from rayapp.inference.tiny_model import default_cache_dir

    Handle = _engine_handle(model_dir, str(model_dir))
    package = Path(rayapp.__file__).resolve().parent
    for value, error in ((str(package), "is inside rayapp's own folder"), (str(package / "inference" / ".."),
                         "is inside rayapp's own folder"), ("cache", "is a relative path")):
        monkeypatch.setenv("RAYAPP_CACHE", value)
        with pytest.raises(ValueError, match=re.escape(f"RAYAPP_CACHE={value!r} {error}")):
            asyncio.run(EngineClient(Handle(), "student").info())
    assert not (package / "tokenizers").exists()
    monkeypatch.delenv("RAYAPP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "rayapp"
    folder = Path(asyncio.run(EngineClient(Handle(), "student").info())["tokenizer_path"])
    assert folder.parent == tmp_path / "home" / ".cache" / "rayapp" / "tokenizers"
    monkeypatch.setenv("RAYAPP_CACHE", "~/elsewhere")
    assert default_cache_dir() == tmp_path / "home" / "elsewhere"


# -- the cluster files as written: Ready pods, provisioned folders, rayapp validate -----------------


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_every_recipe_passes_rayapp_validate(path, monkeypatch):
    """The recipe and Ray Serve's schema of its file, as `rayapp validate` checks them (layout paths
    resolve against the directory serve run starts in: the repository root)."""
    from rayapp.cli.check import problems

    monkeypatch.chdir(ROOT)
    assert problems(path) == []


def test_the_grpo_recipe_is_plain_grpo_on_one_sglang_engine():
    path = ROOT / "recipes" / "grpo_sglang" / "rollout.yaml"
    recipe = parse_recipe(_args(path), source=_rel(path))
    assert [e.backend for e in recipe.engines.values()] == ["sglang"]
    assert recipe.dagger is None and all(ev.teacher is None for ev in recipe.evaluators)
    assert all((d.n_samples_per_prompt or 1) > 1 for d in recipe.data.values())  # groups to normalise over
    assert recipe.filters.rejection is not None and recipe.filters.finish_only.whole_group
    assert recipe.pool.cluster_layout is None  # one node: the live cluster, what the engine leaves free
    for ev in recipe.evaluators:
        assert ev.run_resource.gpu == ev.eval_resource.gpu == 0  # the engine holds the GPU


def _mounts(template: dict) -> dict[str, dict]:
    """mount path -> the volume mounted there, for the pod's Ray container."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    (ray_container, *_) = template["spec"]["containers"]
    return {m["mountPath"]: volumes[m["name"]] for m in ray_container.get("volumeMounts", [])}


def _under(path: str, mounts: dict[str, dict]) -> dict | None:
    hits = [m for m in mounts if Path(path).is_relative_to(m)]
    return mounts[max(hits, key=len)] if hits else None


def test_kuberay_worker_pods_become_ready_without_a_serve_proxy_on_them():
    """KubeRay's default readiness probe on a RayService's workers asks the Serve proxy on the pod,
    which runs there only with proxy_location EveryNode: a worker must then bring its own probe."""
    docs = _kuberay_docs()
    config = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    for group in docs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (worker, *_) = group["template"]["spec"]["containers"]
        if config.get("proxy_location", "EveryNode") == "EveryNode":
            continue
        probe = worker.get("readinessProbe")
        assert probe, f"group {group['groupName']}: KubeRay's default probe would wait for a Serve proxy"
        command = " ".join(probe["exec"]["command"])
        assert ":8000" not in command and "-/healthz" not in command
        assert "api/local_raylet_healthz" in command and "grep success" in command


def test_kuberay_provisions_every_folder_the_manager_writes_on_the_head():
    docs = _kuberay_docs()
    head = docs["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    mounts = _mounts(head)
    claims = {d["metadata"]["name"] for d in yaml.safe_load_all(KUBERAY.read_text())
              if d and d["kind"] == "PersistentVolumeClaim"}
    scheduler = _args(SWE)["scheduler"]
    folders = [scheduler[k] for k in ("save_eval_details", "trajectory_dir", "checkpoint_dir")]
    assert all(folders)
    for folder in folders:
        volume = _under(folder, mounts)
        assert volume is not None, f"{folder}: not on a volume of the head pod (the manager runs there)"
        assert volume["persistentVolumeClaim"]["claimName"] in claims  # made by the manifest itself


def test_kuberay_mounts_the_models_where_the_engines_run_and_the_head_needs_none():
    cluster = _kuberay_docs()["RayService"]["spec"]["rayClusterConfig"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    worker_mounts = _mounts(gpu_group["template"])
    for engine in _args(SWE)["engines"].values():
        assert _under(engine["options"]["model_path"], worker_mounts) is not None
    # the manager's agents tokenize with the files the engines send (InferenceEngine.tokenizer_files)
    assert _under("/mnt/models", _mounts(cluster["headGroupSpec"]["template"])) is None


def test_launcher_provisions_the_run_folder_on_the_head_and_the_model_folder_on_the_worker():
    config = _load(LAUNCHER)
    head = " ".join(config["head_setup_commands"])
    worker = " ".join(config["worker_setup_commands"])
    scheduler = _args(SWE)["scheduler"]
    for key in ("save_eval_details", "trajectory_dir", "checkpoint_dir"):
        assert Path(scheduler[key]).is_relative_to("/mnt/runs")
    assert "mkdir -p /mnt/runs" in head
    for engine in _args(SWE)["engines"].values():
        assert Path(engine["options"]["model_path"]).is_relative_to("/mnt/models")
    assert "mkdir -p /mnt/models" in worker
