"""What a request must pass before the API does any work for it, and the errors it hears, in OpenAI's format.

``RequestGate`` is an ASGI middleware in front of the app: the API key (on /v1/ paths), ``application/json`` on
a POST (else 415: a browser sends a cross-origin ``text/plain`` POST without asking first, so any web page could
otherwise drive a server on the user's machine), and a body of at most ``max_body_bytes``.  The body is read here,
chunk by chunk, and reading stops at the limit (413): a chunked body has no Content-Length to check beforehand.
The app then reads the body from memory; what the client sends afterwards (its disconnect) still reaches it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @property
    def body(self) -> dict:
        """OpenAI's error object (``code``: the HTTP status, as vLLM sends it)."""
        kind = {401: "authentication_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


class RequestGate:
    """ASGI middleware: key, media type and body size checked before the app sees a request."""

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None = None):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_headers(scope)
            if scope["method"] == "POST":
                receive = await self._read_body(receive)
        except ApiError as exc:
            return await exc.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check_headers(self, scope) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (
            self.api_key is not None
            and scope["path"].startswith("/v1/")
            and headers.get("authorization") != f"Bearer {self.api_key}"
        ):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        if scope["method"] != "POST":
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(
                415,
                f"the request body must be application/json, not {media or 'untyped'}: send "
                "'Content-Type: application/json'",
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, self._too_large())

    def _too_large(self) -> str:
        return (
            f"the request body is over this server's limit of {self.max_body_bytes} bytes "
            "(autotp serve --max-request-bytes)"
        )

    async def _read_body(self, receive):
        """The whole body, read until it ends or passes the limit; a ``receive`` that hands it out again, then
        passes on what the client sends next."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise ApiError(413, self._too_large())
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list, receive):
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed
