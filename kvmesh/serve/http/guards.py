"""What a request must pass before any work is done for it: the loopback server's Host and Origin
checks, the API key, and a body read within its size and time bounds and parsed as JSON (off the
event loop: a big body's JSON takes a while)."""

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from kvmesh.serve.api_errors import ApiError

# Names a loopback server answers to. A web page's request to 127.0.0.1 that arrives under another
# Host (DNS rebinding) or from another Origin (a page's script) is refused: without an API key the
# loopback API is open to whatever reaches it, and a browser reaches it for any page it shows.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# The names by which a container on this Mac reaches its loopback (Docker Desktop's and OrbStack's,
# Podman's, Lima's and so Colima's): Open WebUI in Docker calls http://host.docker.internal:8080/v1.
# No public DNS name is one of them (.internal is reserved for private use), so a rebinding page
# cannot take them; and a browser's request under them still carries its Origin, which is checked.
CONTAINER_HOSTS = frozenset(
    {
        "host.docker.internal",
        "gateway.docker.internal",
        "host.orb.internal",
        "host.containers.internal",
        "host.lima.internal",
    }
)


def host_name(value: str) -> str:
    """`127.0.0.1:8080` -> `127.0.0.1`, `[::1]:8080` -> `[::1]`, `http://localhost:3000` -> `localhost`."""
    value = value.lower().split("://", 1)[-1].split("/", 1)[0]
    if value.startswith("["):
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class Guard:
    """Who may call: on `loopback`, requests under a Host other than a loopback name, a container's
    name for the host or one of `allowed_hosts` are refused, and so are those from another Origin,
    except from `cors_origins` ("*": any); with `api_key`, only requests that carry it."""

    api_key: str | None = None
    loopback: bool = True
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin in self.cors_origins or host_name(origin) in LOOPBACK_NAMES

    def check(self, request: Request) -> None:
        """Refuse (ApiError 403 or 401) a request this server does not answer."""
        if self.loopback:
            host = host_name(request.headers.get("host", ""))
            origin = request.headers.get("origin")
            if host not in LOOPBACK_NAMES | CONTAINER_HOSTS | {name.lower() for name in self.allowed_hosts}:
                raise ApiError(
                    403,
                    f"this server answers loopback requests only, and {host!r} is not a name of this machine: "
                    "call it as 127.0.0.1, localhost, [::1] or host.docker.internal (from a container), or "
                    "give --allowed-host NAME; serve with --host and --api-key to be reached from elsewhere",
                    code="forbidden",
                )
            if origin is not None and not self.origin_allowed(origin):
                raise ApiError(
                    403,
                    f"this server does not answer web pages of {origin}: give --web-origin {origin} to let "
                    "that page call it from a browser",
                    code="forbidden",
                )
        if self.api_key is None:
            return
        # OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key` (Claude Code either).
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        given = given or request.headers.get("x-api-key", "").strip()
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer ..., or x-api-key)", code="invalid_api_key"
            )


async def read_body(request: Request, *, max_body_bytes: int, read_timeout: float) -> bytes:
    """The body, refused as soon as it is known to pass `max_body_bytes` (by its Content-Length,
    or as it arrives), so a huge body is never held; and refused when it stops arriving for
    `read_timeout` seconds, so a client that never finishes it holds nothing for long."""
    too_large = ApiError(413, f"the body is over {max_body_bytes:,} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    stream = request.stream()
    while True:
        try:
            part = await asyncio.wait_for(anext(stream), read_timeout)
        except StopAsyncIteration:
            return b"".join(parts)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the body stopped arriving for {read_timeout:g} s", code="request_timeout") from None
        except ClientDisconnect:  # nobody reads the answer; it only ends the request quietly
            raise ApiError(400, "the client went away before its body arrived", code="client_gone") from None
        size += len(part)
        if size > max_body_bytes:
            raise too_large
        parts.append(part)


def parse_json(raw: bytes) -> Any:
    """The body's JSON, or the 400 that says why it is not."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        message = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise ApiError(400, f"the body is not valid JSON: {message}", code="invalid_json") from None
