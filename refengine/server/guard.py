"""An ASGI middleware in front of every route: the Host allow-list (403), the API key (401) and the request
body limit (413), each answered in the OpenAI error shape before the app runs.

The body limit holds whether or not the client sends Content-Length: a declared length over the limit is
refused here before any of the body is read; the handlers read bodies with read_body, which refuses one
that grows past it as it arrives."""

from __future__ import annotations

import hmac
import json
from typing import Any

from refengine.server.config import OPEN_PATHS, ServerConfig
from refengine.server.protocol import ApiError

Scope = dict[str, Any]


def _host_name(value: str) -> str:
    """The host of a Host header value, without its port, lower case ("[::1]:8000" -> "::1")."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


async def send_error(send: Any, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Any, cfg: ServerConfig):
        self.app, self.cfg = app, cfg
        self.key = cfg.api_key.encode() if cfg.api_key else None

    def check(self, scope: Scope) -> ApiError | None:
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.lower(), v)
        if self.cfg.host_names:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.cfg.host_names:
                return ApiError(403, f"Host {host!r} is not allowed", None, "invalid_request_error", "invalid_host")
        if self.key is not None and scope.get("path") not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return ApiError(
                    401,
                    "a valid API key is needed: send the header `Authorization: Bearer <key>`",
                    None,
                    "invalid_request_error",
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return ApiError(400, "Content-Length is not a number")
            if n > self.cfg.max_request_bytes:
                return too_large(self.cfg.max_request_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self.check(scope)
        if err is not None:
            await send_error(send, err)
            return
        await self.app(scope, receive, send)


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes (Content-Length may be absent)."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise too_large(limit)
        parts.append(part)
    return b"".join(parts)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {limit} bytes (--max-request-bytes)", None, code="request_too_large"
    )
