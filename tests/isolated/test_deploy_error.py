"""A deployment that still fails (an agent factory that fails only beside the real engines, so
``rayapp validate`` cannot see it) is told by the CLI's wait for the app with the exception's own
line and the recipe field, not only the log's path. On the isolated files' shared Ray head (conftest.py)."""

import pytest
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT

FACTORY = '''import ray

from rayapp.envs.agents.chat import ChatAgent


def make(deps):
    if ray.is_initialized():  # in the manager's replica, not under validate
        return ChatAgent(deps.engine)
    return ChatAgent(deps.engine, deps.verify)
'''


def test_a_failed_deployment_names_the_exception_and_the_field(head, tmp_path):
    (head.modules / "late_agents.py").write_text(FACTORY)  # on the head's PYTHONPATH, as a user's module
    cfg = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    cfg["applications"][0]["args"]["evaluators"][0]["agent"] = "late_agents:make"
    with pytest.raises(RuntimeError) as e, serve_app(head, cfg, tmp_path, timeout_s=300):
        pass
    message = str(e.value)
    assert message.startswith("application rayapp is DEPLOY_FAILED: "), message
    assert "$.evaluators[0].agent: agent 'late_agents:make': building it with AgentDeps failed: TypeError: " \
           "ChatAgent.__init__() missing 1 required positional argument: 'verify'" in message, message
    assert f"(full log: {tmp_path / 'serve.log'})" in message
