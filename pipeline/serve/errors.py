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
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"WWW-Authenticate": 'Basic realm="pipeline"'} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {kind}: {ident}", param="id")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"File too large: at most {limit} bytes", param="file", code="file_too_large"
    )


def too_many(message: str) -> ApiError:
    return ApiError(429, message, type="requests", code="rate_limit_exceeded")
