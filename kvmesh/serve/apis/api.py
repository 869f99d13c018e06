"""What the HTTP layer needs of an API: its body made into a Turn, each answer written back (whole,
or as the events of its stream) and its error body. One generic handler runs them all
(kvmesh.serve.http.app), so what differs between the APIs is only what is here."""

from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.responses import Response

from kvmesh.serve.api_errors import ApiError
from kvmesh.serve.turns import Outcome, Piece, Turn


class Reply(Protocol):
    """One answer as its API writes it (its id and creation time are the reply's own)."""

    def complete(self, outcome: Outcome) -> dict:
        """The whole answer's body, not streamed."""
        ...

    def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Any]:
        """The answer's server-sent events as they come (sse-starlette's strings or dicts), ending
        with the API's error event when generation fails."""
        ...


class Api(Protocol):
    """One HTTP API of the server."""

    @property
    def claude_names(self) -> bool:
        """Whether any "claude-..." model name is the served model (the Anthropic API's clients ask so)."""
        ...

    def turn_of(self, body: dict, vocab: int) -> Turn:
        """The request's Turn, or the ApiError that refuses it."""
        ...

    def reply(self, body: dict, turn: Turn, tokenizer: Any) -> Reply:
        """The writer of the answer to `body`."""
        ...

    def error(self, e: ApiError) -> Response:
        """`e` as this API's error response."""
        ...
