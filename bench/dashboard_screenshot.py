"""A screenshot of the dashboard under load: bench/results/dashboard.png.

    python bench/dashboard_screenshot.py [--model [NAME=]SOURCE ...] [--seconds 40] [--concurrency 4] [SERVE FLAGS]

Starts ``tokenmill serve --model ...`` (a subprocess on a free port; flags this script does not
know go to it, ``--routes`` among them; every name /v1/models lists gets traffic), opens
/dashboard in headless Chromium (Debian's ``chromium``, driven by Playwright) polling every
second, sends completions and chats, streamed or not, from client threads whose
number ramps from 1 to --concurrency over --seconds, waits for the idle tail to show in the
charts, and saves a full-page screenshot. Exit status 1 when the page logged an error.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from launch import free_port, wait_ready

RESULTS = Path(__file__).parent / "results"
WORDS = "the quick brown fox jumps over a lazy dog while seven tired engineers measure tail latency".split()


def client(base: str, models: list[str], seed: int, stop: threading.Event) -> None:
    """Requests one after another until ``stop``: a completion or a chat, every other one streamed."""
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=120) as http:
        while not stop.is_set():
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
            body = {"model": rng.choice(models), "max_tokens": rng.randint(16, 64), "ignore_eos": True,
                    "stream": rng.random() < 0.5}
            if rng.random() < 0.5:
                path, body = "/v1/completions", {**body, "prompt": text}
            else:
                path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
            if body["stream"]:
                with http.stream("POST", path, json=body) as response:
                    for _ in response.iter_bytes():
                        pass
            else:
                http.post(path, json=body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                        help="a model to serve (repeatable; default smollm2-135m-instruct)")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the traffic lasts")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads at the end of the ramp")
    parser.add_argument("--out", default=str(RESULTS / "dashboard.png"))
    args, serve_flags = parser.parse_known_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path("/tmp/dashboard_screenshot_server.log")
    with log.open("w") as out:
        models = [flag for m in args.model or ["smollm2-135m-instruct"] for flag in ("--model", m)]
        server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", *models, "--port", str(port),
                                   *serve_flags], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(base, server, str(log))
        served = [card["id"] for card in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base + "/dashboard?interval_ms=1000")
            stop, threads = threading.Event(), []
            start = time.monotonic()
            while (elapsed := time.monotonic() - start) < args.seconds:
                wanted = 1 + int(elapsed / args.seconds * args.concurrency)
                while len(threads) < min(wanted, args.concurrency):
                    threads.append(threading.Thread(target=client, args=(base, served, len(threads), stop), daemon=True))
                    threads[-1].start()
                time.sleep(0.2)
            stop.set()
            for thread in threads:
                thread.join()
            time.sleep(4)  # the idle tail
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(f"wrote {args.out}")
        if errors:
            print("the page logged errors:", *errors, sep="\n  ")
            sys.exit(1)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
