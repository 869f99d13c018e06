"""Servers and clients of `kvmesh serve`. The server: `InProcessServer`, the app the command runs,
served in the test's own process, for the tests that do not test the process. The clients, well-behaved
and not, on raw sockets and http.client so each can call from an address of its own (Linux answers
all of 127/8 on loopback): ones that ask for a big streamed answer and never read it, one that reads
it a byte a second, big prompts under the body limit, and the well-behaved client whose /health and
small request must keep being answered."""

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import anthropic
    import openai

    from kvmesh.model.loaded import LoadedModel

# A streamed answer far larger than what the kernel and asyncio buffer for one connection: each
# token's chunk carries its 20 most likely alternatives.
BIG_ANSWER = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Where do rivers go?"}],
    "max_tokens": 400,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
}
SMALL = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of a base URL such as http://127.0.0.1:8000/v1."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def post_head(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


def never_reading(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` that asks for BIG_ANSWER and reads none of it (a small receive
    buffer, so the server's bytes pile up on its side). The caller closes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(host_port(url))
    body = json.dumps(BIG_ANSWER).encode()
    sock.sendall(post_head("/v1/chat/completions", body) + body)
    return sock


# Linux's tcpi_state of a connection the server reset, and of one it closed (its FIN read or not).
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8


def cut(sock: socket.socket) -> bool:
    """Whether the server has cut `sock` (reset or closed it), seen without reading from it: a
    reader a byte a second would take hours to reach the end of what its buffers already hold."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (TCP_CLOSE, TCP_CLOSE_WAIT)


class SlowReader:
    """A connection that asks for BIG_ANSWER and reads it a byte a second (a very bad link, or a
    hostile client), on its own thread, until the server cuts it or `close`."""

    def __init__(self, url: str, source: str = "127.0.0.1"):
        self.sock = never_reading(url, source)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.wait(1.0):
            try:
                if not self.sock.recv(1):
                    return
            except OSError:
                return

    def cut_within(self, seconds: float) -> bool:
        """Whether the server cut this reader within `seconds`."""
        deadline = time.monotonic() + seconds
        while not (cut(self.sock) or not self._thread.is_alive()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def health_from(url: str, source: str, timeout: float) -> int:
    """/health's status for a client calling from `source` (0: no answer within `timeout`)."""
    host, port = host_port(url)
    connection = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def post_from(url: str, path: str, body: bytes, source: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of a POST from `source` to the server's `path` ((0, b"") without an answer
    within `timeout`)."""
    host, port = host_port(url)
    connection = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        connection.close()


def small_request_from(url: str, source: str, timeout: float) -> bool:
    """Whether a small chat request from `source` got its two tokens within `timeout`."""
    status, answer = post_from(url, "/v1/chat/completions", json.dumps(SMALL).encode(), source, timeout)
    try:
        return status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
    except (ValueError, KeyError, TypeError):
        return False


def big_prompt(kind: str, size: int) -> tuple[str, bytes]:
    """(path, body) of a request of about `size` bytes whose prompt is most of it: `text` (one long
    message), `messages` (thousands of short ones) or `token ids` (a completions prompt of token ids)."""
    if kind == "text":
        content = ("the river runs to the sea " * (size // 26 + 1))[: size - 200]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return "/v1/chat/completions", json.dumps(body).encode()
    if kind == "messages":
        count = (size - 200) // 60
        messages = [{"role": "user" if i % 2 else "assistant", "content": f"line {i} of it"} for i in range(count)]
        return "/v1/chat/completions", json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2}).encode()
    if kind == "token ids":
        ids = [(i * 7919) % 200 + 4 for i in range((size - 200) // 5)]
        return "/v1/completions", json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2}).encode()
    raise ValueError(kind)


def timed(call, *args) -> tuple[object, float]:
    """`call(*args)` and the seconds it took."""
    began = time.monotonic()
    return call(*args), time.monotonic() - began


class InProcessServer:
    """`kvmesh --data-dir DATA_DIR serve MODEL_DIR --no-mesh` (or, with `peers`, `--peer ADDRESS`
    for each) as the command builds it (kvmesh.serve.server.build_app: the same app, engine and
    prompt cache over the store in `data_dir`, the prefill rates it keeps there with peers, the same
    uvicorn server and connection bounds), served on a thread of this process at a loopback port:
    real HTTP for the official clients and raw sockets, with no process started and `loaded` (the
    model of `model_dir`) loaded once by the caller. `options` are ServeOptions' fields
    (`max_body_bytes=...` for `--max-body-bytes`); `store` False: `--no-store`; `log`: where the
    package's log lines go while it serves, as the command writes them to its stderr."""

    def __init__(
        self,
        model_dir: Path,
        loaded: "LoadedModel",
        data_dir: Path,
        *,
        peers: tuple[str, ...] = (),
        store: bool = True,
        log: Path | None = None,
        **options: Any,
    ):
        # (imported here: the raw clients above serve scripts that load neither MLX nor the server)
        from kvmesh.net.addresses import host_port as url_host_port
        from kvmesh.reuse.rates import Rates
        from kvmesh.serve.options import ServeOptions
        from kvmesh.serve.server import build_app, http_server, listen
        from kvmesh.store import CacheStore

        self.log = log
        self._logging = log_to(log) if log is not None else None
        settings = ServeOptions(model=str(model_dir), peers=peers, **options)
        stored, rates = CacheStore(data_dir / "store") if store else None, Rates(data_dir) if peers else None
        self.serving = build_app(settings, loaded, store=stored, peers=list(peers), credentials=None, rates=rates)
        self.engine = self.serving.engine
        self.server, backlog = http_server(self.serving.app, settings)
        # Listening before uvicorn runs: a client's connection waits in the backlog until it does.
        self.sock = listen(settings.host, 0, backlog)
        self.url = f"http://{url_host_port(settings.host, self.sock.getsockname()[1])}/v1"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()

    def openai(self, **options: Any) -> "openai.OpenAI":
        """The official OpenAI client of this server."""
        import openai

        return openai.OpenAI(base_url=self.url, **{"api_key": "unused", "max_retries": 0, "timeout": 120, **options})

    def anthropic(self, **options: Any) -> "anthropic.Anthropic":
        """The official Anthropic client of this server."""
        import anthropic

        base_url = self.url.removesuffix("/v1")
        return anthropic.Anthropic(
            base_url=base_url, **{"api_key": "unused", "max_retries": 0, "timeout": 120, **options}
        )

    def stop(self) -> None:
        """As `kvmesh serve` stops: uvicorn's open requests end, then the engine and the parsing
        threads (once: a test may stop it before its fixture does)."""
        if self.server.should_exit:
            return
        self.server.should_exit = True
        self._thread.join(30)
        self.serving.app.state.parse_pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()
        self.engine.close(timeout=5.0)
        if self._logging is not None:
            self._logging()


def log_to(path: Path) -> Callable[[], None]:
    """The package's log lines from INFO up written to `path` as `kvmesh serve` writes them
    (kvmesh.daemon.logs' text format); returns what undoes it."""
    package = logging.getLogger("kvmesh")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = package.level
    package.setLevel(logging.INFO)
    package.addHandler(handler)

    def undo() -> None:
        package.removeHandler(handler)
        package.setLevel(level)
        handler.close()

    return undo
