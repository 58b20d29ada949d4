"""Inside the sandbox: the command's end of the gateway bridge (``bridge.py`` has the host's end).

``python3 -I -S -c <this source> SOCKET KEY_FILE URL_PATH -- ARGV...``, run as the sandbox's command
(its user, its rlimits, its namespaces). Standard library only: the project's checkout is not in the
sandbox's root, so the host passes this file's text on the command line.

It listens on 127.0.0.1 of the sandbox's own network namespace (a free port), starts ARGV with
``OPENAI_BASE_URL`` (that port, the episode's path) and ``OPENAI_API_KEY`` (read from KEY_FILE, so
the key is never on a command line another user could read) added to its environment (and the OpenAI
Agents SDK's tracing switched off, ``OPENAI_AGENTS_DISABLE_TRACING=1``), and carries
each connection's bytes to SOCKET, the host's forwarder. It ends as ARGV ends: its exit code, or
killed by the same signal. It is the command's parent in the command's process group, so the
sandbox's wall clock, a cancellation and the PID namespace end both together.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

CHUNK = 1 << 16


def pump(src, dst):
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # half-close: the other direction may still carry the reply


def carry(conn, path):
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    back = threading.Thread(target=pump, args=(up, conn), daemon=True)
    back.start()
    pump(conn, up)
    back.join()
    conn.close()
    up.close()


def serve(listener, path):
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=carry, args=(conn, path), daemon=True).start()


def main():
    path, key_file, url_path, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5:]
    with open(key_file) as f:
        key = f.read().strip()
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    env = dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{port}{url_path}", OPENAI_API_KEY=key)
    env.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # the Agents SDK's tracing would send the episode out
    threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as e:
        os.write(2, f"sandbox: cannot run {argv[0]!r}: {e.strerror}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    code = child.wait()
    if code < 0:  # killed by a signal: end the same way, so the sandbox reports it as the command's
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set (nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
