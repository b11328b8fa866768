"""Run the app under uvicorn; SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones
finish (up to ``drain_timeout``), then the server stops. A second signal stops it at once.

:func:`uvicorn_config` is the one place a uvicorn.Config is built (``serve`` and the tests' live
server): HTTP/1.1 through :class:`~tokenmill.server.connections.GuardedH11Protocol`, so the
header timeout and the per-client connection cap hold wherever the app is served."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import uvicorn

from tokenmill.llm import LLM
from tokenmill.server.app import build_app, create_state
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.model_pool import ModelLoader
from tokenmill.server.connections import guarded_protocol
from tokenmill.server.state import ServerState

logger = logging.getLogger("tokenmill.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_deadline is not None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        logger.info("draining: %d request(s) in flight; new requests get 503", self.state.in_flight)
        self.state.draining = True  # ServingMiddleware answers new requests with 503
        self._drain_deadline = time.monotonic() + self.state.config.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        draining = self._drain_deadline is not None and not self.should_exit
        if draining and (self.state.in_flight == 0 or time.monotonic() > self._drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app, config: ServerConfig, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for ``app`` under ``config`` (address, connection guards); ``kwargs`` go to
    uvicorn.Config and win over these."""
    protocol = guarded_protocol(config.header_timeout, config.max_connections_per_client, config.retry_after)
    return uvicorn.Config(app, **{"host": config.host, "port": config.port, "http": protocol, **kwargs})


def serve(models: LLM | dict[str, LLM], config: ServerConfig, cost: CostConfig | None = None,
          loader: ModelLoader | None = None, load_seconds: dict[str, float] | None = None) -> None:
    """Serve loaded models until SIGTERM/SIGINT (arguments: ``create_state``'s): the engine steps in
    this (the main) thread, where the models were loaded, and uvicorn serves HTTP from a second
    thread (why: AsyncEngine's docstring). Signals arrive in the main thread and go to the
    server's drain logic."""
    run(create_state(models, config, cost, loader, load_seconds))


def run(state: ServerState, app=None) -> None:
    """Serve ``app`` (default: ``build_app(state)``) until SIGTERM/SIGINT: HTTP from a second
    thread, the engine's ``run_here`` in this one (a scale-out front's RemoteEngine only waits there)."""
    config = state.config
    sys.setswitchinterval(0.001)  # the engine holds the GIL in its Python parts; hand it over sooner
    uv = uvicorn_config(app if app is not None else build_app(state), config, log_level="info",
                        timeout_graceful_shutdown=5)
    server = DrainingServer(uv, state)
    logger.info("serving %s on http://%s:%d", ", ".join(state.models), config.host, config.port)

    exit_code: list[int] = []

    def serve_http() -> None:
        try:
            server.run()  # the lifespan's engine.start() is a no-op, its engine.stop() ends run_here()
        except SystemExit as exc:  # uvicorn exits 1 when it cannot start (port taken, ...)
            exit_code.append(exc.code if isinstance(exc.code, int) else 1)
        except BaseException:
            logger.exception("the HTTP server failed")
            exit_code.append(1)
        finally:
            state.engine.stop(timeout=0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    state.engine.will_run_here()  # before uvicorn runs the lifespan: its engine.start() is then a no-op
    http = threading.Thread(target=serve_http, name="tokenmill-http")
    http.start()
    state.engine.run_here()
    http.join()
    if exit_code and exit_code[0]:
        raise SystemExit(exit_code[0])  # the process exits as uvicorn would have in the main thread
