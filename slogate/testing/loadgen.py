"""A streaming load generator: N concurrent closed-loop clients on one aiohttp session, each
sending chat streams and checking that every one ends properly (its `finish_reason` and
`[DONE]`, the number of tokens asked for). Used by the load tests and the soak / overload
benchmarks; aiohttp rather than the OpenAI SDK because the SDK's httpx pool costs quadratic
time at a thousand concurrent streams (docs/benchmarks.md), which would measure the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class StreamResult:
    started: float
    ended: float
    status: int
    tokens: int
    complete: bool  # finish_reason seen and [DONE] received
    error: str = ""
    first_token: float | None = None
    retry_after: str | None = None
    text: str = ""  # the answer's text, as received
    usage_out: int | None = None  # completion_tokens of the usage chunk (asked with stream_options.include_usage)


@dataclass
class LoadReport:
    results: list[StreamResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.status == 200 and r.complete]
        statuses = Counter(r.status for r in self.results)
        return {"requests": len(self.results), "completed": len(ok), "statuses": dict(statuses),
                "incomplete_200": sum(r.status == 200 and not r.complete for r in self.results),
                "errors": [r.error for r in self.results if r.error][:5]}


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> StreamResult:
    t0 = time.monotonic()
    tokens, finish, done, first, text, usage = 0, False, False, None, [], None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                await r.read()
                return StreamResult(t0, time.monotonic(), r.status, 0, False, retry_after=r.headers.get("retry-after"))
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    return StreamResult(t0, time.monotonic(), 200, tokens, False, str(ev["error"].get("message"))[:200], first, text="".join(text))
                for ch in ev.get("choices") or ():
                    content = (ch.get("delta") or {}).get("content")
                    if content:
                        tokens += 1
                        text.append(content)
                        first = first or time.monotonic()
                    finish = finish or ch.get("finish_reason") is not None
                if isinstance(ev.get("usage"), dict):
                    usage = ev["usage"].get("completion_tokens", usage)
            return StreamResult(t0, time.monotonic(), 200, tokens, finish and done, "", first, text="".join(text), usage_out=usage)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return StreamResult(t0, time.monotonic(), -1, tokens, False, f"{type(e).__name__}: {e}"[:200], first)


async def closed_loop(base_url: str, clients: int, duration_s: float, body: dict[str, Any], timeout_s: float = 120.0,
                      ramp_s: float = 5.0, on_result: Any = None) -> LoadReport:
    """`clients` concurrent loops, each sending `body` until `duration_s` has passed (started
    evenly over `ramp_s`). Every request started is waited for (so a hang shows as a timeout)."""
    report = LoadReport()
    url = f"{base_url}/v1/chat/completions"
    stop_at = time.monotonic() + duration_s
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def loop(i: int) -> None:
            await asyncio.sleep(ramp_s * i / max(clients, 1))
            while time.monotonic() < stop_at:
                res = await stream_once(session, url, body, timeout_s)
                report.results.append(res)
                if on_result is not None:
                    on_result(res)
                if res.status in (429, 503):
                    await asyncio.sleep(min(float(res.retry_after or 1), 5.0))

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return report
