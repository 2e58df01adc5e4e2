"""Server-sent events from OpenAI-compatible engines: split, inspect, and build.

The gateway forwards each upstream event's bytes unchanged; it only looks inside to count
tokens (one per content delta, or the running usage count where the engine sends one; the final
usage chunk gives the exact count) and to drop the usage it asked for when the client did not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class EventInfo:
    tokens: int = 0  # generated tokens this event carries (content deltas)
    usage_out: int | None = None  # exact completion tokens, from a usage report
    usage_in: int | None = None
    usage_only: bool = False  # a chunk with no choices that only reports usage
    done: bool = False  # data: [DONE]
    error: bool = False
    text: str = ""  # the answer text this event adds (content delta, completion text)
    opaque: bool = False  # it adds something a continuation cannot carry on (reasoning, tool calls)
    finished: bool = False  # a choice's finish_reason: the answer is whole (nothing left to resume)
    ids: list[int] | None = None  # the answer's token ids it adds (vLLM `return_token_ids`)
    prompt_ids: list[int] | None = None  # the prompt's token ids (the first chunk, with `return_token_ids`)
    head: tuple[str, int] | None = None  # the chunk's id and `created`, where it carries prompt ids


# A chunk's `"usage": {...}` member (one level of nesting: prompt_tokens_details), to strip the
# per-chunk usage the gateway asked for when the client did not.
USAGE_FIELD = re.compile(rb',\s*"usage":\s*(?:null|\{(?:[^{}]|\{[^{}]*\})*\})')
_ID_KEYS = (b'"token_ids":', b'"prompt_token_ids":')


def hide_ids(event: bytes) -> bytes:
    """vLLM's `token_ids` / `prompt_token_ids` arrays as null (what vLLM sends unasked), for a
    client that did not ask for them. Plain `find`: 4x faster than a regex, once per token."""
    for key in _ID_KEYS:
        i = event.find(key)
        while i >= 0:
            k, n = i + len(key), len(event)
            while k < n and event[k] == 32:  # a space after the colon (Python's json.dumps)
                k += 1
            j = event.find(b"]", k) if k < n and event[k] == 91 else -1  # 91: "["
            if j < 0:
                i = event.find(key, k)  # null already
                continue
            event = event[:i] + key + b"null" + event[j + 1:]
            i = event.find(key, i + len(key))
    return event


class EventSplitter:
    """Cuts a byte stream into whole SSE events (terminated by a blank line)."""

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self.buf = b""
        self.max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self.buf + (chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk)
        out = []
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            out.append(buf[: i + 2])
            buf = buf[i + 2 :]
        if len(buf) > self.max:
            raise ValueError("an upstream event exceeds the size limit")
        self.buf = buf
        return out

    def rest(self) -> list[bytes]:
        """What is left at the end of the stream (an unterminated last event)."""
        rest, self.buf = self.buf, b""
        return [rest + b"\n\n"] if rest.strip() else []


def inspect(event: bytes) -> EventInfo:
    info = EventInfo()
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            info.done = True
            continue
        try:
            d = orjson.loads(payload)  # once per token of every stream: ~5x faster than json here
        except orjson.JSONDecodeError:
            continue
        if isinstance(d, dict):
            _inspect_obj(d, info)
    return info


def _inspect_obj(d: dict[str, Any], info: EventInfo) -> None:
    if d.get("error"):
        info.error = True
        return
    typ = d.get("type")
    if isinstance(typ, str):  # Responses API events
        if typ == "response.output_text.delta" and d.get("delta"):
            info.tokens += 1
        elif typ == "response.completed":
            u = (d.get("response") or {}).get("usage") or {}
            info.usage_out, info.usage_in = u.get("output_tokens"), u.get("input_tokens")
        return
    choices = d.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if not isinstance(c, dict):
                continue
            if c.get("finish_reason"):
                info.finished = True
            ids = c.get("token_ids")
            if isinstance(ids, list):
                info.ids = ids if info.ids is None else info.ids + ids
            if c.get("prompt_token_ids") is not None:  # a completion's, in its first choice
                info.prompt_ids, info.head = c["prompt_token_ids"], (d.get("id"), d.get("created"))
            delta = c.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if content or delta.get("reasoning_content") or delta.get("tool_calls"):
                    info.tokens += 1
                    if isinstance(content, str):
                        info.text += content
                    if delta.get("reasoning_content") or delta.get("tool_calls"):
                        info.opaque = True
            elif c.get("text"):
                info.tokens += 1
                if isinstance(c["text"], str):
                    info.text += c["text"]
    if d.get("prompt_token_ids") is not None:  # a chat stream's, beside its first chunk's choices
        info.prompt_ids, info.head = d["prompt_token_ids"], (d.get("id"), d.get("created"))
    u = d.get("usage")
    if isinstance(u, dict):
        info.usage_out, info.usage_in = u.get("completion_tokens"), u.get("prompt_tokens")
        if not choices:
            info.usage_only = True


def error_event(message: str, type_: str = "upstream_error", code: str | None = None) -> bytes:
    return f"data: {json.dumps({'error': {'message': message, 'type': type_, 'param': None, 'code': code}})}\n\n".encode()


KEEPALIVE = b": keep-alive\n\n"
