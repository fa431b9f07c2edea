"""Python exceptions to gRPC status codes, with the Python API's messages."""

from __future__ import annotations

import grpc

from pprun.engine.async_engine import EngineClosedError, QueueFullError
from pprun.executor.base import StageFailedError


class NotFoundError(LookupError):
    """An unknown model name or request id (NOT_FOUND)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a failed call reports for ``exc``.

    Bad input is INVALID_ARGUMENT; an unknown model or request NOT_FOUND; a full queue
    RESOURCE_EXHAUSTED; a failed stage or a server shutting down UNAVAILABLE; anything else a
    bug, INTERNAL.
    """
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (EngineClosedError, StageFailedError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The message sent with the status: the exception's own text (what the Python API raises)."""
    text = str(exc) or type(exc).__name__
    if status_for(exc) is grpc.StatusCode.INTERNAL:
        text = f"internal error: {type(exc).__name__}: {text}"
    return text
