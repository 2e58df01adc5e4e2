"""A simulated vLLM engine behind an OpenAI-compatible HTTP API, in real time.

The simulator's `EngineSim` (continuous batching, chunked prefill, KV blocks, recompute
preemption; step time from the batch latency model) is stepped by an asyncio task on the wall
clock, so token timing reacts to load as a real engine's does. It serves `/v1/chat/completions`,
`/v1/completions` and `/v1/responses` (streaming and not, `stream_options.include_usage` and
`continuous_usage_stats`),
`/v1/models`, `/health` and vLLM-style `/metrics` (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`). Like vLLM it honours `max_tokens`,
`ignore_eos` (exact lengths) and, with priority scheduling on, the `priority` field (lower
first); a client that disconnects aborts its sequence. Without `ignore_eos` the answer length
is drawn from a log-normal seeded by the prompt, so the same prompt gets the same length.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import math
import random
import re
import struct
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from slogate.router.prefix import text_block_hashes
from slogate.sim.engine import BLOCK
from slogate.sim.realtime import FixedLatencyEngine, RealtimeEngine


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt_text(body: dict[str, Any]) -> str:
    if isinstance(body.get("messages"), list):
        parts = []
        for m in body["messages"]:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts.extend(str(p.get("text", "")) for p in c if isinstance(p, dict))
        return "\n".join(parts)
    p = body.get("prompt", body.get("input", ""))
    return p if isinstance(p, str) else json.dumps(p)


def answer_length(text: str, max_tokens: int | None, ignore_eos: bool, median: float = 120.0, sigma: float = 0.8) -> int:
    cap = max_tokens if max_tokens and max_tokens > 0 else 1024
    if ignore_eos:
        return cap
    seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest(), "little")
    n = round(median * math.exp(random.Random(seed).gauss(0.0, sigma)))
    return max(1, min(n, cap))


def _err(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}, "object": "error"}, status_code=status)


_TOK = re.compile(r"tok\d+ ")


ANSWER_ID = 100_000  # token `tokN` has id ANSWER_ID + N; prompt ids are below it


def prompt_ids(text: str) -> list[int]:
    """The prompt's token ids, as vLLM's `return_token_ids` gives them: one per 4 characters."""
    return [1 + zlib.crc32(text[i:i + 4].encode()) % (ANSWER_ID - 1) for i in range(0, len(text), 4)] or [1]


def _continued_tokens(body: dict[str, Any], chat: bool) -> int:
    """How many numbered tokens the answer being continued already has: from the text
    (`continue_final_message`, a completion prompt ending in generated text) or from a prompt of
    token ids (vLLM's /v1/completions), whose answer ids must be exactly ANSWER_ID + 0, 1, … in
    order; anything else numbers from a million, so a test sees the ids were wrong."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        answer = [t - ANSWER_ID for t in prompt if t >= ANSWER_ID]
        return len(answer) if answer == list(range(len(answer))) and prompt[len(prompt) - len(answer):] == [
            ANSWER_ID + k for k in answer] else 1_000_000
    if chat:
        msgs = body.get("messages") or []
        last = msgs[-1] if msgs and isinstance(msgs[-1], dict) else {}
        if body.get("continue_final_message") and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            return len(_TOK.findall(last["content"]))
        return 0
    prompt = body.get("prompt")
    return len(_TOK.findall(prompt)) if isinstance(prompt, str) else 0


def create_engine_app(model: str = "sim-model", fixed_ttft_ms: float | None = None, fixed_itl_ms: float = 20.0,
                      fixed_kw: dict[str, Any] | None = None, hold_every: int = 0, models_delay_ms: float = 0.0,
                      chars_per_token: float = 4.0, **engine_kw: Any) -> FastAPI:
    """`fixed_ttft_ms` set: a fixed-latency engine (FixedLatencyEngine, `fixed_kw`: its jitter
    and stalls) instead of the batch model. `hold_every` k > 1: streamed with token ids, token
    tokN with N % k == k − 1 is part of a character as vLLM's detokenizer sees it: its text is
    held back and goes out with the next token's, and it shares a chunk with the token before it
    (a busy engine merging two steps); a continuation whose prompt ids end with it gets vLLM's
    answer to a prompt ending inside a character: the whole prompt back as answer text (here
    "ECHO "). `models_delay_ms`: `/v1/models` answers that late (vLLM's API server on saturated
    cores) while tokens keep flowing. `chars_per_token`: how a text prompt is counted (a real
    tokenizer's ratio on the client's text, to stand in for a real engine on the same prompts)."""
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if fixed_ttft_ms is not None:
            state["engine"] = FixedLatencyEngine(fixed_ttft_ms / 1000, fixed_itl_ms / 1000, engine_kw.get("priority_scheduling", False),
                                                 **(fixed_kw or {}))
        else:
            state["engine"] = RealtimeEngine(**engine_kw)
        state["engine"].start()
        yield
        await state["engine"].stop()

    app = FastAPI(title="slogate simulated engine", lifespan=lifespan)
    app.state.models_delay_s = models_delay_ms / 1000  # a test may change it while the engine runs

    def engine() -> RealtimeEngine:
        return state["engine"]

    def tokens_in(text: str) -> int:
        """A text's tokens, `chars_per_token` characters each (prompts and embedding inputs alike)."""
        return int(len(text) / chars_per_token) + 1

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's (dev mode): forget every cached block, so the next system a benchmark runs
        starts cold, as it does on real engines."""
        e = engine().eng
        e.prefix_cache = None
        e.answers.clear()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        if app.state.models_delay_s:
            await asyncio.sleep(app.state.models_delay_s)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "slogate-sim", "max_model_len": 8192}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        e = engine()
        lab = f'{{model_name="{model}"}}'
        text = (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {e.running}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{lab} {e.waiting}\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{lab} {e.kv_usage:.4f}\n"
                f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{lab} {e.eng.preemptions}\n"
                f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{lab} {e.eng.prefix_queries}\n"
                f"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{lab} {e.eng.prefix_hits}\n"
                f'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="{e.eng.total_blocks}"}} 1.0\n'
                f"# TYPE slogate_sim_aborted_total counter\nslogate_sim_aborted_total{lab} {e.aborted}\n"
                f"# TYPE slogate_sim_finished_total counter\nslogate_sim_finished_total{lab} {e.finished}\n"
                f"# TYPE slogate_sim_peak_requests gauge\nslogate_sim_peak_requests{lab} {e.peak}\n")
        if isinstance(e, RealtimeEngine):  # vLLM's latency histograms, as their sums and counts (one +Inf bucket)
            for name, total, n in (("vllm:time_to_first_token_seconds", e.ttft_sum, e.ttft_count),
                                   ("vllm:request_time_per_output_token_seconds", e.tpot_sum, e.tpot_count)):
                text += (f"# TYPE {name} histogram\n{name}_bucket{{model_name=\"{model}\",le=\"+Inf\"}} {n}\n"
                         f"{name}_sum{lab} {total}\n{name}_count{lab} {n}\n")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _body(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _err(400, "invalid JSON body")
        if not isinstance(body, dict):
            return _err(400, "the body must be a JSON object")
        if body.get("model") != model:
            return _err(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        prio = body.get("priority", 0)
        if prio and not engine().priority_scheduling:
            return _err(400, "Priority scheduling is not enabled.", param="priority")
        return body

    def _tokens(body: dict[str, Any], max_key: str) -> tuple[int, int, AsyncIterator[int]]:
        text = _prompt_text(body)
        n_in = len(body["prompt"]) if isinstance(body.get("prompt"), list) else tokens_in(text)
        n_out = answer_length(text, body.get(max_key) or body.get("max_completion_tokens"), bool(body.get("ignore_eos")))
        e = engine()
        # Prefix caching on the prompt's text blocks (a block is as many tokens as n_in counts in its characters).
        rid, q = e.submit(n_in, n_out, int(body.get("priority") or 0), text_block_hashes(text), chars_per_token)

        async def gen() -> AsyncIterator[int]:
            try:
                while True:
                    i = await q.get()
                    if i is None:
                        return
                    yield i
            finally:
                e.abort(rid)  # no-op when it finished; frees the sequence on disconnect

        return n_in, n_out, gen()

    def _usage(n_in: int, n_out: int, responses: bool = False) -> dict[str, int]:
        if responses:
            return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def _sse(obj: dict[str, Any] | str) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

    async def _complete(request: Request, chat: bool) -> Any:
        """Chat completions and legacy completions: the same flow, different shapes."""
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        n_in, n_out, toks = _tokens(body, "max_tokens")
        # Tokens are numbered ("tok0 tok1 …"), so a client can check a stream has none lost or
        # repeated; a continuation (vLLM's `continue_final_message`, or a completion prompt that
        # ends in generated text) numbers on from the tokens it already holds.
        first = _continued_tokens(body, chat)
        cid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        finish = "length" if body.get("max_tokens") and n_out >= body["max_tokens"] else "stop"

        def piece(text: str | None, fin: str | None, whole: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": fin}
            if whole:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin}
            return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": fin}

        if not body.get("stream"):
            # Like vLLM's `with_cancellation`: a client that leaves aborts its sequence.
            async def count() -> int:
                n = 0
                async for _ in toks:
                    n += 1
                return n

            work = asyncio.ensure_future(count())
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                await toks.aclose()  # type: ignore[attr-defined]
                return Response(status_code=499)
            n = work.result()
            return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
                    "choices": [piece("".join(f"tok{first + i} " for i in range(n)), finish, whole=True)], "usage": _usage(n_in, n)}
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage"))
        continuous = include_usage and bool(so.get("continuous_usage_stats"))  # vLLM: the running count in every chunk

        ids = bool(body.get("return_token_ids"))  # vLLM: the prompt's ids first, then each chunk's
        p_ids = (body["prompt"] if isinstance(body.get("prompt"), list) else prompt_ids(_prompt_text(body))) if ids else None

        async def stream() -> AsyncIterator[bytes]:
            base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": model}
            n = 0
            if chat:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                            "prompt_token_ids": p_ids})
            hold = hold_every if ids and hold_every > 1 else 0
            echo = "ECHO " if hold and p_ids and p_ids[-1] >= ANSWER_ID and (p_ids[-1] - ANSWER_ID) % hold == hold - 1 else ""
            held, out = "", []  # text held back; ids not yet sent
            async for _ in toks:
                k = first + n
                n += 1
                out.append(k)
                if hold and k % hold == hold - 2:
                    continue  # merged into the next step's chunk
                if hold and k % hold == hold - 1:  # part of a character: its text waits for the next token's
                    text, held = "".join(f"tok{j} " for j in out[:-1]), f"tok{k} "
                else:
                    text, held, echo = echo + held + "".join(f"tok{j} " for j in out), "", ""
                c = piece(text, None)
                if ids:
                    c["token_ids"], out = [ANSWER_ID + j for j in out], []
                    if not chat and n == len(c["token_ids"]):
                        c["prompt_token_ids"] = p_ids
                else:
                    out = []
                yield _sse({**base, "choices": [c], **({"usage": _usage(n_in, n)} if continuous else {})})
            if held or out:  # the answer ended on a held or merged token
                c = piece(held + "".join(f"tok{j} " for j in out), None)
                if ids and out:
                    c["token_ids"] = [ANSWER_ID + j for j in out]
                yield _sse({**base, "choices": [c], **({"usage": _usage(n_in, n)} if continuous else {})})
            yield _sse({**base, "choices": [piece(None, finish)]})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(n_in, n)})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(request: Request) -> Any:
        """A pooling model's answer: one unit-length vector per input, a function of the input
        (equal inputs, equal vectors), after one prefill of all of them in the engine."""
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        raw = body.get("input")
        items = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)) else raw
        if not isinstance(items, list) or not items:
            return _err(400, "input must be a string, a list of strings or a list of token lists", param="input")
        dims = body.get("dimensions") or 16
        if not isinstance(dims, int) or not 1 <= dims <= 16384:
            return _err(400, "dimensions must be an integer from 1 to 16384", param="dimensions")
        n_in = sum(len(x) if isinstance(x, list) else tokens_in(str(x)) for x in items)
        e = engine()
        rid, q = e.submit(n_in, 1, int(body.get("priority") or 0))
        try:
            await q.get()  # the prefill
        finally:
            e.abort(rid)
        data = []
        for i, x in enumerate(items):
            seed = hashlib.sha256(json.dumps(x).encode()).digest()
            rng = random.Random(seed)
            vec = [rng.uniform(-1, 1) for _ in range(dims)]
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            vec = [v / norm for v in vec]
            emb: Any = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if body.get("encoding_format") == "base64" else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "model": model, "data": data, "usage": {"prompt_tokens": n_in, "total_tokens": n_in}}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        return await _complete(request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await _complete(request, chat=False)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> Any:
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        n_in, _, toks = _tokens(body, "max_output_tokens")
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        msg_id = f"msg_{uuid.uuid4().hex}"

        def resp(status: str, text: str, n: int | None) -> dict[str, Any]:
            out = [{"type": "message", "id": msg_id, "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}] if n is not None else []
            return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status, "output": out,
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                    "usage": _usage(n_in, n or 0, responses=True) if n is not None else None}

        if not body.get("stream"):
            n = 0
            async for _ in toks:
                n += 1
            return resp("completed", "tok " * n, n)

        async def stream() -> AsyncIterator[bytes]:
            seq = itertools.count()

            def ev(kind: str, **kw: Any) -> bytes:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **kw})}\n\n".encode()

            yield ev("response.created", response=resp("in_progress", "", None))
            n = 0
            async for _ in toks:
                n += 1
                yield ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta="tok ", logprobs=[])
            yield ev("response.completed", response=resp("completed", "tok " * n, n))

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
