"""The refusal while the engine warms up: 503 ``warming_up`` with Retry-After.

The engine thread warms up before serving (``AsyncEngine.warm_up_first``: the CPU kernels built
or loaded, one tiny generation run) and ``ServerState.warming`` says so meanwhile. Generation
handlers and ``/ready`` call :func:`check_warm` first, so a request is refused at once instead of
waiting in the engine's queue while its deadline runs out behind a compile; ``/health`` does not
(the process is alive).
"""

from __future__ import annotations

from tokenmill.server.errors import APIError
from tokenmill.server.state import ServerState

CODE = "warming_up"


def check_warm(state: ServerState, count: bool = True) -> None:
    """Raise APIError 503 ``warming_up`` (with Retry-After) while the engine is still warming up;
    ``count``: record it in the rejected-requests metric (generation requests; not /ready)."""
    if state.warming:
        if count:
            state.metrics.reject(CODE)
        raise APIError(503, "the server is warming up (building or loading its kernels, running a first step); "
                       "retry shortly", code=CODE, retry_after=state.config.retry_after)
