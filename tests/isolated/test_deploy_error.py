"""A deployment that still fails (an agent factory that fails only beside the real engines, so
``rayapp validate`` cannot see it) is told by the CLI's wait for the app with the exception's own
line and the recipe field, not only the log's path. Runs in its own pytest process (it starts its
own Ray cluster)."""

import os
from pathlib import Path

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT, local_app

FACTORY = '''import ray

from rayapp.envs.agents.chat import ChatAgent


def make(deps):
    if ray.is_initialized():  # in the manager's replica, not under validate
        return ChatAgent(deps.engine)
    return ChatAgent(deps.engine, deps.verify)
'''


def test_a_failed_deployment_names_the_exception_and_the_field(tmp_path, monkeypatch):
    (tmp_path / "late_agents.py").write_text(FACTORY)
    for key, value in LOCAL_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", str(ROOT))]))
    cfg = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    cfg["applications"][0]["args"]["evaluators"][0]["agent"] = "late_agents:make"
    recipe = tmp_path / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    temp_dir = Path(f"/tmp/rayapp-deploy-error-{os.getpid()}")
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError) as e, local_app(recipe, temp_dir, log, timeout_s=300):
        pass
    message = str(e.value)
    assert message.startswith("application rayapp is DEPLOY_FAILED: "), message
    assert "$.evaluators[0].agent: agent 'late_agents:make': building it with AgentDeps failed: TypeError: " \
           "ChatAgent.__init__() missing 1 required positional argument: 'verify'" in message, message
    assert f"(full log: {log})" in message
