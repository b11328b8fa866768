"""`tokenmill serve` as a process: SIGTERM drains (in-flight requests finish, new ones get 503,
/ready turns 503), then the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests(tiny_dir) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_dir), "--port", str(port),
                             "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        # an in-flight request: headers sent, the body still coming
        body = json.dumps({"model": MODEL, "prompt": "drain me", "max_tokens": 4}).encode()
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 2})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/ready").status_code == 503
        assert httpx.get(url + "/health").status_code == 200
        assert proc.poll() is None, "the server left before its in-flight request finished"
        slow.sendall(body[5:])
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = slow.recv(65536)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert b'"finish_reason":"length"' in reply
        slow.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_already_taken_fails_the_process(tiny_dir) -> None:
    """uvicorn runs in a second thread (the engine has the main one); its start-up failure must
    still end the process with a non-zero status, not a quiet 0."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_dir), "--port", str(port),
                               "--device", "cpu", "--dtype", "float32"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "address already in use" in done.stderr
