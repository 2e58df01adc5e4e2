"""Helpers for fault tests: simulated engines as separate processes (so they can be killed,
stopped and restarted like a real vLLM), and a load of real openai-SDK clients that records
what happened to every request."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from slogate.testing.ports import free_port
from slogate.testing.prom import gauge

MODEL = "sim-model"


class EngineProcess:
    """`slogate engine` in its own process group, on a fixed port that survives restarts."""

    def __init__(self, port: int | None = None, *args: str, model: str = MODEL) -> None:
        self.port = port or free_port()
        self.args = args
        self.model = model
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        self.proc = subprocess.Popen([sys.executable, "-c", "from slogate.cli import app; app()", "engine", "--port", str(self.port),
                                      "--model", self.model, *self.args], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine on {self.port} exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"engine on {self.port} did not start")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with_cont = True
            try:
                self.signal(signal.SIGKILL)
            except ProcessLookupError:
                with_cont = False
            if with_cont:
                self.proc.wait(10)

    def metric(self, name: str) -> float:
        v = gauge(self.url, name)
        if v is None:
            raise KeyError(name)
        return v

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGCONT)
        self.kill()


@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # completed | stream_error | refused | error
    tokens: int = 0
    stream: bool = True
    detail: str = ""


@dataclass
class Load:
    """Worker threads sending requests through the real openai SDK until `stop_at` (monotonic)."""

    base_url: str
    workers: int
    stop_at: float
    max_tokens: int = 40
    stream_share: float = 1.0
    outcomes: list[Outcome] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, c: openai.OpenAI, stream: bool) -> Outcome:
        t0 = time.monotonic()
        kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "fault test"}], "max_tokens": self.max_tokens,
                              "extra_body": {"ignore_eos": True}}
        n = 0
        try:
            if stream:
                finish = None
                for ch in c.chat.completions.create(stream=True, **kw):
                    if ch.choices:
                        n += 1 if ch.choices[0].delta.content else 0
                        finish = ch.choices[0].finish_reason or finish
                kind = "completed" if finish is not None else "error"
            else:
                r = c.chat.completions.create(**kw)
                n = r.usage.completion_tokens if r.usage else 0
                kind = "completed"
            return Outcome(t0, time.monotonic(), kind, n, stream)
        except (openai.RateLimitError, openai.InternalServerError) as e:
            kind = "refused" if getattr(e, "status_code", 0) in (429, 503) else "error"
            return Outcome(t0, time.monotonic(), kind, n, stream, str(e)[:200])
        except openai.APIError as e:
            # An `error` event mid-stream surfaces as an APIError while iterating.
            kind = "stream_error" if (stream and n > 0) or "upstream" in str(e) else "error"
            return Outcome(t0, time.monotonic(), kind, n, stream, str(e)[:200])

    def _worker(self, i: int) -> None:
        c = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        k = 0
        while time.monotonic() < self.stop_at:
            stream = (k * 7 + i) % 10 < self.stream_share * 10
            o = self.one(c, stream)
            with self.lock:
                self.outcomes.append(o)
            k += 1

    def start(self) -> Load:
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float) -> bool:
        """True when every worker finished in time (no request hung)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0))
        return not any(t.is_alive() for t in self.threads)


class Watch(threading.Thread):
    """Samples a gateway gauge every 50 ms: (time, value) pairs."""

    def __init__(self, url: str, name: str, **labels: str) -> None:
        super().__init__(daemon=True)
        self.url, self.name, self.labels = url, name, labels
        self.samples: list[tuple[float, float | None]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                self.samples.append((time.monotonic(), gauge(self.url, self.name, **self.labels)))
            time.sleep(0.05)

    def first(self, after: float, value: float) -> float | None:
        return next((t for t, v in self.samples if t >= after and v == value), None)


def numbered_answer(base: str, prompt: str, n: int, chat: bool, extra: dict[str, Any] | None = None,
                    timeout: float = 120) -> tuple[str, Any, str | None, set[str]]:
    """One streamed answer of `n` tokens through the openai SDK (chat or legacy completion, usage
    asked): its text, usage, error (None) and the chunk ids it came in. Fails if a chunk carries
    token ids the client did not ask for (the gateway asks vLLM for them to resume by ids)."""
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout)
    text, usage, err, ids = "", None, None, set()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True},
                          "extra_body": {"ignore_eos": True, **(extra or {})}}
    try:
        it = (c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw) if chat
              else c.completions.create(prompt=prompt, **kw))
        for ch in it:
            ids.add(ch.id)
            usage = ch.usage or usage
            assert not (ch.model_extra or {}).get("prompt_token_ids"), ch
            for choice in ch.choices:
                assert not (choice.model_extra or {}).get("token_ids"), ch
                text += (choice.delta.content or "") if chat else choice.text
    except openai.APIError as e:
        err = str(e)
    return text, usage, err, ids
