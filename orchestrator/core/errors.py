"""Typed errors the edges translate: each maps to one HTTP status in the server; RequestFault, an executor's."""
from __future__ import annotations

from orchestrator.core.types import RequestId, SampledToken


class MFSError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MFSError):
    """Bad input: names the offending field in `param`."""
    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(MFSError):
    status_code = 404
    error_type = "model_not_found"


class QueueFullError(MFSError):
    """Overload: the bounded global queue is full; retry after `retry_after_s`."""
    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailableError(MFSError):
    """The engine (for example Triton) is down or not ready."""
    status_code = 503
    error_type = "service_unavailable"


class AuthenticationError(MFSError):
    """--api-key is set and the request's bearer token is missing or wrong."""
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLargeError(MFSError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeoutError(MFSError):
    """The request outlived scheduler.request_timeout_s (non-streaming answer)."""
    status_code = 504
    error_type = "timeout"
    code = "request_timeout"


class RequestFault(Exception):
    """An executor's step that failed for some of its requests only (their own sampling), raised once the others
    are done: `errors` fails each of those alone (request id -> its MFSError), `sampled` has the others' tokens."""

    def __init__(self, errors: dict[RequestId, MFSError], sampled: list[SampledToken]):
        super().__init__("; ".join(f"{request_id}: {error.message}" for request_id, error in errors.items()))
        self.errors, self.sampled = errors, sampled
