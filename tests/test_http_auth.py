"""The manager's HTTP access rule and step-id parsing (rayapp.actors.http_auth, rayapp.actors.http_errors):
the decisions themselves; tests/isolated/test_auth_serve.py checks them through Serve's proxy."""

import json
import os
import threading

import pytest

from rayapp.actors.http_auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    HttpGuard,
    is_loopback,
    load_token,
    ray_cluster_token,
)
from rayapp.actors.http_errors import parse_step_id

TOKEN = "0123456789abcdef0123456789abcdef"
RAY_TOKEN = "fedcba9876543210fedcba9876543210"


def body(response) -> dict:
    return json.loads(response.body)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "localhost"])
def test_without_a_token_a_loopback_proxy_serves_only_rays_cluster_token(host):
    """No route is open by default: another user of the machine (POST /rollout/5) gets 401."""
    assert is_loopback(host)
    guard = HttpGuard(None, RAY_TOKEN)
    assert guard.refusal(f"Bearer {RAY_TOKEN}", host) is None
    for header in (None, "", f"Bearer {TOKEN}", f"Bearer {RAY_TOKEN[:-1]}"):
        answer = guard.refusal(header, host)
        assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
        assert "Ray's cluster token" in body(answer)["message"] and RAY_TOKEN not in answer.body.decode()
    shut = HttpGuard(None, None).refusal(f"Bearer {RAY_TOKEN}", host)  # Ray's token auth off: nothing to present
    assert shut.status_code == 403 and "RAY_AUTH_MODE=token" in body(shut)["message"]


def test_rays_token_is_not_asked_for_across_a_network():
    answer = HttpGuard(None, RAY_TOKEN).refusal(f"Bearer {RAY_TOKEN}", "0.0.0.0")
    assert answer.status_code == 403 and TOKEN_ENV in body(answer)["message"]


def test_with_an_http_token_rays_token_is_not_one(tmp_path):
    assert HttpGuard(TOKEN, RAY_TOKEN).refusal(f"Bearer {RAY_TOKEN}", "127.0.0.1").status_code == 401
    assert HttpGuard(TOKEN, RAY_TOKEN).refusal(f"Bearer {TOKEN}", "127.0.0.1") is None


def test_rays_cluster_token_is_read_where_ray_reads_it(tmp_path):
    (tmp_path / "path-token").write_text(RAY_TOKEN + "-path\n")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(RAY_TOKEN + "-home")
    path = str(tmp_path / "path-token")
    assert ray_cluster_token({"RAY_AUTH_TOKEN": RAY_TOKEN, "RAY_AUTH_TOKEN_PATH": path}, tmp_path) == RAY_TOKEN
    assert ray_cluster_token({"RAY_AUTH_TOKEN_PATH": path}, tmp_path) == RAY_TOKEN + "-path"
    assert ray_cluster_token({}, tmp_path) == RAY_TOKEN + "-home"
    assert ray_cluster_token({}, tmp_path / "nobody") is None
    assert ray_cluster_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path) is None
    assert ray_cluster_token({"RAY_AUTH_TOKEN_PATH": "/dev/zero"}, tmp_path) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "head.example", "", None,
                                  "an unknown host (TimeoutError: )"])
def test_without_a_token_any_other_proxy_host_is_refused_naming_what_to_set(host):
    answer = HttpGuard(None).refusal(None, host)
    assert answer.status_code == 403
    assert TOKEN_ENV in body(answer)["message"] and TOKEN_FILE_ENV in body(answer)["message"]


@pytest.mark.parametrize("header", [None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x",
                                    "Bearer ", f"Bearer {TOKEN.upper()}", "Bearer \u00e9" + TOKEN])
def test_with_a_token_anything_but_that_bearer_token_is_401(header):
    for host in ("127.0.0.1", "0.0.0.0"):  # configured means required, on loopback too
        answer = HttpGuard(TOKEN).refusal(header, host)
        assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
        assert TOKEN not in answer.body.decode()


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN} "])
def test_the_bearer_token_is_served_on_any_host(header):
    assert HttpGuard(TOKEN).refusal(header, "0.0.0.0") is None


def test_the_token_comes_from_the_environment_or_a_file(tmp_path):
    assert load_token({}) is None and load_token({TOKEN_ENV: ""}) is None
    assert load_token({TOKEN_ENV: TOKEN}) == TOKEN
    (tmp_path / "t").write_text(TOKEN + "\n")  # a mounted Secret's file, trailing newline and all
    assert load_token({TOKEN_FILE_ENV: str(tmp_path / "t")}) == TOKEN
    (tmp_path / "link").symlink_to(tmp_path / "t")  # a Secret volume's file is a link
    assert load_token({TOKEN_FILE_ENV: str(tmp_path / "link")}) == TOKEN


@pytest.mark.parametrize(("env", "needle"), [
    ({TOKEN_ENV: "short"}, f"{TOKEN_ENV}: the token must be 16"),
    ({TOKEN_ENV: "with a space in it, long enough"}, "without spaces"),
    ({TOKEN_ENV: TOKEN, TOKEN_FILE_ENV: "/x"}, "not both"),
    ({TOKEN_FILE_ENV: "/nonexistent/token"}, f"{TOKEN_FILE_ENV}=/nonexistent/token: not a readable regular file"),
    ({TOKEN_FILE_ENV: "/"}, "not a readable regular file"),
    ({TOKEN_FILE_ENV: "/dev/zero"}, "not a readable regular file"),
])
def test_a_configured_token_that_cannot_be_used_is_one_clear_error(env, needle):
    with pytest.raises(ValueError, match=needle):
        load_token(env)


def test_a_fifo_as_the_token_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def load():
        try:
            load_token({TOKEN_FILE_ENV: str(fifo)})
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=5)
    assert not t.is_alive() and "not a readable regular file" in str(errors[0])


def test_a_binary_or_huge_token_file_is_refused(tmp_path):
    (tmp_path / "bin").write_bytes(b"\xff" * 32)
    (tmp_path / "big").write_text("a" * 10_000)
    with pytest.raises(ValueError, match="ASCII"):
        load_token({TOKEN_FILE_ENV: str(tmp_path / "bin")})
    with pytest.raises(ValueError, match="16 to 4096"):
        load_token({TOKEN_FILE_ENV: str(tmp_path / "big")})


@pytest.mark.parametrize(("raw", "value"), [("0", 0), ("7", 7), ("2147483647", 2**31 - 1)])
def test_canonical_step_ids_parse(raw, value):
    assert parse_step_id(raw) == value


@pytest.mark.parametrize("raw", ["+5", " 1", "1 ", "1.0", "01", "00", "-0", "-1", "0x1", "1e3", "1_0", "",
                                 "\u0661", "\u2460", "2147483648", "9" * 400, None, 5])
def test_any_other_step_id_is_one_value_error(raw):
    with pytest.raises(ValueError, match=r"step id .* must be a decimal integer in 0 \.\. 2147483647") as e:
        parse_step_id(raw)
    assert len(str(e.value)) < 200


def test_the_knob_reference_lists_the_token_variables():
    from rayapp.knobs import OTHER_ENV

    assert {TOKEN_ENV, TOKEN_FILE_ENV} <= set(OTHER_ENV)
