"""OpenAI-shaped error answers: ``{"error": {"message", "type", "param", "code"}}`` with the
status codes OpenAI uses."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answer: raised by a handler, turned into OpenAI's shape by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = {"message": message, "type": type, "param": param, "code": code}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Basic realm="pipeline"'} if self.status == 401 else None
        return JSONResponse({"error": self.error}, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"File too large: at most {limit} bytes", param="file", code="file_too_large"
    )
