"""The refusal while the engine warms up: 503 ``warming_up`` with Retry-After.

The engine thread warms up before serving (``AsyncEngine.warm_up_first``: the CPU kernels built
or loaded, one tiny generation run) and ``ServedModel.warming`` says so meanwhile. Generation
handlers and ``/ready`` call :func:`check_warm` first, so a request is refused at once instead of
waiting in the engine's queue while its deadline runs out behind a compile; ``/health`` does not
(the process is alive).
"""

from __future__ import annotations

from tokenmill.server.errors import APIError
from tokenmill.server.state import ServedModel, ServerState

CODE = "warming_up"


def check_warm(state: ServerState, model: ServedModel | None = None) -> None:
    """Raise APIError 503 ``warming_up`` (with Retry-After) while ``model`` (None: any model, for
    /ready) is still warming up; a model's refusals are counted in the rejected-requests metric."""
    if not (model.warming if model is not None else state.warming):
        return
    if model is not None:
        state.metrics.reject(model.name, CODE)
    raise APIError(503, "the server is warming up (building or loading its kernels, running a first step); "
                       "retry shortly", code=CODE, retry_after=state.config.retry_after)
