"""Starting a server process for a benchmark: a free port, and waiting until ``/ready`` answers 200."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: str, timeout: float = 900) -> None:
    """Until ``base``/ready answers 200; SystemExit naming ``log`` when the process exits or ``timeout`` passes."""
    stop = time.monotonic() + timeout
    while time.monotonic() < stop:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server did not become ready in {timeout:.0f} s; see {log}")
