"""One client request on its way through the gateway, and what to undo if it ends early."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass

import aiohttp
from starlette.requests import Request

from slogate.gateway.admission import Admission, Ticket
from slogate.gateway.slo import Resolved
from slogate.gateway.workflows import LiveCall
from slogate.router.goodput import RequestLedger
from slogate.router.request import Request as CoreRequest


class AnswerText:
    """An answer's text so far, joined every 256 pieces: a string object per token would cost
    ~57 bytes each for as long as the stream lasts (io.StringIO keeps them too, up to 100,000)."""

    __slots__ = ("blocks", "n", "tail")

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.tail: list[str] = []
        self.n = 0  # characters so far

    def write(self, s: str) -> None:
        self.n += len(s)
        self.tail.append(s)
        if len(self.tail) >= 256:
            self.blocks.append("".join(self.tail))
            self.tail.clear()

    def getvalue(self) -> str:
        return "".join(self.blocks) + "".join(self.tail)


@dataclass(eq=False, slots=True)
class Exchange:
    kind: str  # which OpenAI / vLLM endpoint (schema.PATHS)
    adm: Admission  # the model's admission queue
    req: CoreRequest
    res: Resolved
    labels: tuple[str, str, str]  # model, tier, SLO class: every metric's labels
    stream: bool
    big: bool  # a body large enough to be encoded off the event loop
    ticket: Ticket | None = None  # the ticket holding a replica slot now (None: no slot held)
    resp: aiohttp.ClientResponse | None = None  # the upstream response open now
    freed: Ticket | None = None  # a paced stream's ticket, its slot given back when the engine finished
    first_bound: float = 0.0  # the length bound at dispatch (the predictor's coverage metric)
    client_usage: tuple[bool, bool] = (False, False)  # the client asked for the usage chunk / usage in every chunk
    led: RequestLedger | None = None  # what the client received, when
    # Resuming an answer on another replica when its replica fails mid-stream: the text so far
    # (None: the answer cannot be continued, e.g. tool calls), the tokens earlier attempts made,
    # and the prompt's token count from the first attempt's usage.
    text: AnswerText | None = None
    resumed: int = 0
    prompt_tokens: int | None = None
    # On vLLM, the token ids too (`return_token_ids`): a continuation from the very tokens the
    # engine had (prompt ids + answer ids, through /v1/completions) is exact where re-tokenized
    # text may merge characters differently and change the answer.
    ids: MutableSequence[int] | None = None  # the answer's token ids so far (None: not tracked)
    prompt_ids: list[int] | None = None  # the templated prompt's ids, from the first attempt
    ids_whole: int = 0  # how many of `ids` the client has the text of (none held back as part of a character)
    text_whole: int = 0  # the characters of the answer those `ids_whole` ids make
    again: str = ""  # text the client has that a continuation makes again: not sent twice
    head: tuple[str, int] | None = None  # the first attempt's chunk id and `created`, kept on a continuation
    hide_ids: bool = False  # the gateway asked for the ids, the client did not: they go out as null
    upstream_kind: str | None = None  # the endpoint the open attempt uses, when not `kind` (chat continued as a completion)
    call: LiveCall | None = None  # its place in an agent workflow (stage, sub-deadline), told when it ends


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class Disconnect:
    """While open: a client that disconnects cancels the handler task (its wait in the queue,
    for the upstream's headers, for a whole answer) and `gone` says so. One watcher task, no
    per-step tasks on the hot path. The StreamingResponse watches the client itself afterwards."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.gone = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[Disconnect]:
        handler = asyncio.current_task()

        def on_disconnect(w: asyncio.Task[None]) -> None:
            if not w.cancelled() and w.exception() is None and handler is not None:
                self.gone = True
                handler.cancel()

        watcher = asyncio.get_running_loop().create_task(_disconnected(self.request))
        watcher.add_done_callback(on_disconnect)
        try:
            yield self
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
