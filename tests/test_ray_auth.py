"""The tests' own Ray (conftest's ray_session) keeps Ray's token authentication on, with a throwaway
token outside ~/.ray: a driver without that token, or with another, cannot connect."""

import os
import subprocess
import sys
from pathlib import Path

CONNECT = "import ray, sys; ray.init(address=sys.argv[1], logging_level='error', log_to_driver=False); print('IN')"


def test_the_test_cluster_refuses_a_driver_without_its_token(ray_session, tmp_path):
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    assert is_token_auth_enabled()
    token_file = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert (Path.home() / ".ray") not in token_file.parents
    assert token_file.stat().st_mode & 0o077 == 0  # this user's only
    address = ray_session.get_runtime_context().gcs_address
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}  # no ~/.ray/auth_token to fall back on
    for extra in ({}, {"RAY_AUTH_TOKEN": "0" * 64}):
        run = subprocess.run([sys.executable, "-c", CONNECT, address], env=base | extra, capture_output=True,
                             text=True, timeout=180)
        assert run.returncode != 0 and "IN" not in run.stdout, (extra, run.stdout[-500:])
        assert "token" in run.stderr.lower(), run.stderr[-1500:]
    ok = subprocess.run([sys.executable, "-c", CONNECT, address], capture_output=True, text=True, timeout=180)
    assert ok.stdout.strip().endswith("IN"), ok.stderr[-1500:]
