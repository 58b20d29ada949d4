"""A head from ``start_head`` (issue 32, points 10 and 12): ``serve run`` of a config that fails to import,
onto a cluster already running an app of that name, is judged by the new deployment (its error, not
the old one's RUNNING); and ``stop_cluster`` leaves no process of the cluster, the ones Ray retitles
(``ray::DashboardAgent``, ``ray-dashboard-*Head-0``) included. Runs in its own pytest process (it
starts its own Ray cluster)."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT, _bin, free_port, ray_processes, start_head, stop_cluster, wait_for_app
from rayapp.cli.local_cluster import _started, app_status, auth_token

GOOD = "from ray import serve\n\n@serve.deployment(num_replicas=1, ray_actor_options={'num_cpus': 0})\n" \
       "class Hello:\n    def __call__(self, request):\n        return 'hello'\n\napp = Hello.bind()\n"
BAD = "raise RuntimeError('broken on purpose')\n"


def _config(tmp_path: Path, module: str, port: int) -> Path:
    path = tmp_path / f"{module}.yaml"
    path.write_text(yaml.safe_dump({"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
                                    "applications": [{"name": "hello", "route_prefix": "/hello",
                                                      "import_path": f"{module}:app"}]}))
    return path


def _tree(roots: set[int]) -> set[int]:
    """``roots`` and all their descendants, from ps."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _serve_run(address: str, config: Path, log) -> subprocess.Popen:
    return subprocess.Popen([_bin("serve"), "run", f"--address={address}", str(config)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_a_redeploy_is_judged_by_itself_and_the_stop_leaves_no_process(tmp_path, monkeypatch):
    (tmp_path / "hello_good.py").write_text(GOOD)
    (tmp_path / "hello_bad.py").write_text(BAD)
    for key, value in LOCAL_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    temp_dir = Path(f"/tmp/rayapp-local-cluster-{os.getpid()}")
    log_path = tmp_path / "serve.log"
    procs = []
    with auth_token(), open(log_path, "w") as log:
        try:
            address = start_head(0, 2, temp_dir, free_port(), log)
            port = free_port()
            procs.append(_serve_run(address, _config(tmp_path, "hello_good", port), log))
            wait_for_app(address, "hello", 300, procs[-1], log_path)
            before = app_status(address, "hello")[3]
            assert before is not None
            procs.append(_serve_run(address, _config(tmp_path, "hello_bad", port), log))
            with pytest.raises(RuntimeError) as e:
                wait_for_app(address, "hello", 300, procs[-1], log_path, before)
            assert "RuntimeError: broken on purpose" in str(e.value), e.value

            # Every process under the cluster's own (gcs_server, raylet, dashboard: their command lines
            # name the folder) is found, whatever title Ray gave it.
            out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
            named = {int(line.split(None, 1)[0]) for line in out.splitlines() if str(temp_dir) in line}
            tree = _tree(named) - {os.getpid()}
            found = set(ray_processes(temp_dir))
            assert tree <= found, {p: Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in tree - found}
            started = {pid: _started(pid) for pid in found}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            left = stop_cluster(temp_dir)
    assert left == []
    assert not [pid for pid, at in started.items() if at and _started(pid) == at]
