"""The refusal every API of `kvmesh serve` raises: an HTTP status and an OpenAI-shaped error.

Kept apart from `app` so the translators (tools, anthropic, responses) raise it without importing
the application; the Anthropic API reshapes it into its own error body.
"""

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request the API refuses: an HTTP status and an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}  # e.g. a 429's Retry-After
        super().__init__(message)

    @property
    def kind(self) -> str:
        if self.status >= 500:
            return "server_error"
        return {401: "authentication_error", 429: "requests"}.get(self.status, "invalid_request_error")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def refuse(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400 about `param`."""
    return ApiError(400, message, param, code)
