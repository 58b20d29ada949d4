"""What authenticates what on the local app (docs/security.md), as `rayapp run` starts it: a Ray head with token
authentication and `serve run` of the local recipe, with an HTTP token configured the way a cluster would
(RAYAPP_HTTP_TOKEN_FILE in the application's runtime_env). On the isolated files' shared Ray head (conftest.py).

- Every listening socket of the cluster's processes is on loopback, or refuses a gRPC call that
  carries no token: Serve's replicas (pool, engine, manager) listen on all interfaces for the
  gRPC between deployments, which unpickles the request's metadata, so a call without the token
  must not reach it (the same call with the token does: the port is that server).
- The manager's HTTP routes need the bearer token; step ids are canonical decimal integers.
"""

import ipaddress
import json
import os
import pickle
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT, ray_processes

HTTP_TOKEN = "rayapp-test-" + os.urandom(16).hex()


class Touch:
    """Unpickled, it creates ``path``: what a caller could make a replica do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _addr(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc writes each 32-bit word little-endian
    return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)


def listening(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """The TCP sockets each process listens on, from /proc (no psutil here)."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                sockets[fields[9]] = _addr(fields[1])
    out = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # gone, or not ours to read
            continue
        inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
        out[pid] = sorted(sockets[i] for i in inodes if i in sockets)
    return out


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them: Ray's workers (the replicas among them) retitle
    themselves, so only their parentage says which cluster they belong to."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found)


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def handle_request(port: int, marker: Path, token: str | None):
    """Serve's inter-deployment call with a pickle that creates ``marker``; the gRPC status code."""
    import grpc
    from ray.serve.generated.serve_pb2 import ASGIRequest, ASGIResponse

    request = ASGIRequest(pickled_request_metadata=pickle.dumps(Touch(str(marker))))
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest",
                                   request_serializer=ASGIRequest.SerializeToString,
                                   response_deserializer=ASGIResponse.FromString)
        try:
            call(request, metadata=metadata, timeout=20)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def http(url: str, method: str = "GET", token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    token_file = tmp / "http-token"
    token_file.write_text(HTTP_TOKEN + "\n")
    cfg = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    application = cfg["applications"][0]
    application["runtime_env"] = {"env_vars": {"RAYAPP_HTTP_TOKEN_FILE": str(token_file)}}
    application["args"]["scheduler"]["save_eval_details"] = str(tmp / "details")
    with serve_app(head, cfg, tmp):
        yield {"address": head.address, "http": f"http://127.0.0.1:{head.http_port}/rayapp",
               "temp_dir": head.temp_dir, "tmp": tmp, "ray_token": ray_token()}


def ray_token() -> str | None:
    """The token local_app made for its head (None when Ray's authentication is off)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).read_text().strip() if os.environ.get("RAY_AUTH_MODE") == "token" and path else None


def test_every_socket_is_loopback_or_refuses_a_call_without_the_token(app):
    ports = listening(with_descendants(ray_processes(app["temp_dir"])))
    replicas = {pid: socks for pid, socks in ports.items() if "ServeReplica:rayapp" in title(pid)}
    names = {title(pid).split(":")[-1] for pid in replicas}
    assert {"PlacementPoolService", "engine-student", "SchedulerRolloutManager"} <= names, \
        {pid: title(pid) for pid in ports}
    outside = {(pid, ip, port) for pid, socks in ports.items() for ip, port in socks if not is_loopback(ip)}
    for pid, ip, port in sorted(outside):
        marker = app["tmp"] / f"without-token-{port}"
        code = handle_request(port, marker, None)
        assert code.name == "UNAUTHENTICATED", (title(pid), ip, port, code)
        assert not marker.exists(), (title(pid), port)
    for pid, socks in replicas.items():  # each replica's gRPC server is one of those, and the token opens it
        served = []
        for ip, port in socks:
            if is_loopback(ip):
                continue
            marker = app["tmp"] / f"with-token-{port}"
            handle_request(port, marker, app["ray_token"])
            served += [port] if marker.exists() else []
        assert len(served) == 1, (title(pid), socks, served)


def test_http_routes_need_the_token(app):
    base = app["http"]
    assert http(f"{base}/healthz") == (200, {"ok": True})  # open: probes carry no token
    for method, route in (("POST", "rollout/5"), ("POST", "eval/5"), ("GET", "status"), ("GET", "placement"),
                          ("GET", "rollout/5")):
        for token in (None, "not-" + HTTP_TOKEN):
            status, body = http(f"{base}/{route}", method, token)
            assert status == 401 and body["error"] == "Unauthorized", (method, route, token, body)
    status, body = http(f"{base}/status", token=HTTP_TOKEN)
    assert status == 200 and body["steps_run"] == {"rollout": 0, "eval": 0}, body  # nothing started
    assert http(f"{base}/rollout/5", token=HTTP_TOKEN)[0] == 404


def test_step_ids_are_canonical_decimal_integers(app):
    base = app["http"]
    for bad in ("+5", "%201", "1.0", "01", "-0", "0x1", "1e3", "%E2%91%A0", "-1", "2147483648", "9" * 30):
        for method in ("POST", "GET"):
            status, body = http(f"{base}/rollout/{bad}", method, HTTP_TOKEN)
            assert status == 422 and body["error"] == "ValueError" and "step id" in body["message"], (bad, body)
    status, body = http(f"{base}/status", token=HTTP_TOKEN)
    assert body["steps_run"] == {"rollout": 0, "eval": 0} and body["busy"] is False, body


def test_handle_calls_with_none_get_one_clear_error(app):
    import ray
    from ray import serve

    ray.init(address=app["address"], namespace="rayapp-auth", logging_level="error", log_to_driver=False)
    try:
        h = serve.get_app_handle("rayapp")
        for call, needle in ((h.update_weights_from_disk.remote("student", None), "path must be a non-empty str"),
                             (h.http_rollout.remote(None, "5"), "this is an HTTP route"),
                             (h.generate.remote(None), "rollout_id must be an int")):
            with pytest.raises(ValueError, match=needle):
                call.result(timeout_s=60)
    finally:
        ray.shutdown()
