"""Continuing a cut answer from its token ids (vLLM): the exact sequence the engine had.

A continuation from text (the answer so far as the start of the assistant message) makes the
next engine re-tokenize that text, and a re-tokenization that merges characters differently
changes a greedy answer (measured on real vLLM, docs/benchmarks.md). vLLM streams each chunk's
token ids and the templated prompt's ids when asked (`return_token_ids`), and its
/v1/completions takes a prompt of token ids; so a chat answer is continued as a completion of
prompt ids + answer ids, and its chunks go back to the client as chat chunks of the same stream.
"""

from __future__ import annotations

from typing import Any

import orjson

from slogate.gateway.exchange import Exchange

# What a chat body and a completion body share: sampling and output controls. Chat-only keys
# (messages, tools, templates, reasoning) have done their part in the prompt ids.
SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty", "logit_bias", "bad_words",
          "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "priority", "user",
          "stream", "stream_options", "return_token_ids", "allowed_token_ids", "vllm_xargs", "cache_salt", "kv_transfer_params")


def by_ids(ex: Exchange, generated: int) -> bool:
    """Whether `ex` can be continued from its token ids: every token of the answer so far has its id."""
    return ex.ids is not None and ex.prompt_ids is not None and len(ex.ids) == generated > 0


def ids_body(body: dict[str, Any], ex: Exchange, max_len: int | None, keep: int | None = None) -> dict[str, Any] | None:
    """The /v1/completions body that continues `ex` from prompt ids + its first `keep` answer ids
    (all by default), for what is left of its answer; None where the length left is unknown (no
    max_tokens and no context length: a completion's default is 16 tokens)."""
    assert ex.ids is not None and ex.prompt_ids is not None
    ids = ex.ids if keep is None else ex.ids[:keep]
    prompt = [*ex.prompt_ids, *ids]
    out = {k: body[k] for k in SHARED if k in body} if ex.kind == "chat" else dict(body)
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(cap, int):
        left = max(cap - len(ids), 1)
    elif max_len:
        left = max(max_len - len(prompt), 1)
    else:
        return None
    out.pop("max_completion_tokens", None)
    out["max_tokens"], out["prompt"] = left, prompt
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(body["min_tokens"] - len(ids), 0)
    return out


def continued(event: bytes, ex: Exchange, drop: int = 0) -> bytes:
    """A chunk of the continuation as the client's stream goes on: the first attempt's chunk id
    and `created`, for a chat answer the completion's text as a chat content delta, without its
    first `drop` characters (text the client already has)."""
    try:
        d = orjson.loads(event[event.index(b"data:") + 5:])
    except (ValueError, orjson.JSONDecodeError):
        return event  # [DONE], comments
    if not isinstance(d, dict) or d.get("object") != "text_completion":
        return event  # an error event goes out as it is
    cid, created = ex.head or (d.get("id"), d.get("created"))
    if drop:
        for c in d.get("choices") or []:
            if isinstance(c.get("text"), str):
                c["text"] = c["text"][drop:]
    if ex.kind != "chat":
        d["id"], d["created"] = cid, created
        return b"data: " + orjson.dumps(d) + b"\n\n"
    choices = []
    for c in d.get("choices") or []:
        ch: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": c.get("text") or ""}, "logprobs": None,
                              "finish_reason": c.get("finish_reason")}
        if "stop_reason" in c:
            ch["stop_reason"] = c["stop_reason"]
        if "token_ids" in c:
            ch["token_ids"] = c["token_ids"]
        choices.append(ch)
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": d.get("model"),
                           "choices": choices}
    for k in ("usage", "system_fingerprint"):
        if k in d:
            out[k] = d[k]
    return b"data: " + orjson.dumps(out) + b"\n\n"
