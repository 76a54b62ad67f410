"""The error a request gets: an HTTP status and a message saying what is wrong, sent as JSON `{"error": ...}`
(the Open Inference Protocol's error body, used by every endpoint)."""

from __future__ import annotations


class RequestError(Exception):
    """An answer other than success: `status` (400, 401, 404, 413, 415, 422, 503, 504, ...), `message` for the
    client, and extra response headers (Retry-After, WWW-Authenticate)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})
