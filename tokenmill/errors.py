"""Exceptions tokenmill raises on bad input. Each message names the problem.

The CLI prints ``str(error)`` on one line and exits non-zero; the server (later)
maps them to OpenAI-style 4xx errors.
"""


class TokenmillError(Exception):
    """Base class: a problem the user can fix (bad model, bad file, bad parameter).

    ``param``: the name of the offending input, when there is one; ``code``: a machine-readable
    reason (the server reports both in its error JSON)."""

    def __init__(self, message: str = "", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFoundError(TokenmillError):
    """The model argument names no file, directory, known model or reachable hub repo."""


class ModelFormatError(TokenmillError):
    """A model file is truncated, corrupt or not in the format its name claims."""


class UnsupportedModelError(TokenmillError):
    """The architecture, tensor quantization type or tokenizer kind is not supported."""


class InvalidParameterError(TokenmillError, ValueError):
    """A sampling or engine parameter is out of range or of the wrong type."""


class ContextLengthError(TokenmillError, ValueError):
    """A prompt (plus requested output) does not fit the model's context window."""
