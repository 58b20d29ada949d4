"""Ray's and Serve's lines stay off the user's terminal unless asked for: a driver that connects with
``rayapp.connect`` prints only its own lines (no Ray banner, no Serve router line, no replica's log or access-log
line), ``connect(verbose=True)`` brings them back, and ``local_app(verbose=True)`` (what ``rayapp run --verbose``
uses) copies ``ray start``'s and ``serve run``'s output to the terminal as well as to the run's log. A one-
replica echo app on a 2-CPU head keeps it cheap. It starts a Ray head of its own (local_app's own-head path)."""

import os
import subprocess
import sys
from pathlib import Path

from rayapp.cli import LOCAL_ENV, local_app, ray_processes

APP = '''import logging

from ray import serve


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Echo:
    def generate(self, x):
        logging.getLogger("ray.serve").info("replica logs %s", x)
        print("replica prints", x)
        return x


app = Echo.bind()
'''

CONFIG = """proxy_location: Disabled
applications:
  - name: rayapp
    route_prefix: null
    import_path: quiet_echo:app
"""

DRIVER = """import sys, time
from rayapp import connect
h = connect(sys.argv[1], verbose=sys.argv[2] == "verbose")
print("RESULT", h.generate.remote(7).result(timeout_s=60), flush=True)
time.sleep(3)  # the replica's lines, when streamed, arrive a moment after the call
"""

# what each source of chatter looks like: the driver's Ray banner, Serve's router in the driver, the
# replica's own log and print lines, Serve's access log of the call
CHATTER = ("Connected to Ray cluster", "SharedRouterLongPollClient", "replica logs 7", "replica prints 7",
           "CALL generate OK")


def test_drivers_are_quiet_by_default_and_verbose_brings_ray_and_serve_back(tmp_path, monkeypatch, capfd):
    (tmp_path / "quiet_echo.py").write_text(APP)
    (tmp_path / "app.yaml").write_text(CONFIG)
    for key, value in LOCAL_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    log = tmp_path / "serve.log"
    temp_dir = Path(f"/tmp/rayapp-quiet-{os.getpid()}")
    with local_app(tmp_path / "app.yaml", temp_dir, log, num_gpus=0, num_cpus=2,
                   timeout_s=300, cwd=tmp_path, verbose=True) as (address, _):
        shown = capfd.readouterr()
        runs = {mode: subprocess.run([sys.executable, "-c", DRIVER, address, mode], capture_output=True, text=True,
                                     timeout=180) for mode in ("quiet", "verbose")}
    assert ray_processes(temp_dir) == []  # local_app's own head is stopped whole, as `rayapp run` stops it
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    quiet, verbose = runs["quiet"], runs["verbose"]
    assert quiet.stdout == "RESULT 7\n", quiet.stdout
    assert not [c for c in CHATTER if c in quiet.stderr], quiet.stderr
    assert all(c in verbose.stdout + verbose.stderr for c in CHATTER), verbose.stdout + verbose.stderr
    # --verbose: ray start's and serve run's lines on the terminal, and in the log as without it
    written = log.read_text()
    for text in (shown.err, written):
        assert "Ray runtime started" in text and "Deploying new app 'rayapp'" in text, text[-3000:]
    # stdout has only local_app's own progress lines ("  serve: Echo updating (15s)" on a slow start)
    assert all(line.startswith("  serve: ") for line in shown.out.splitlines()), shown.out
