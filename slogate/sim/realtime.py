"""Simulated engines that run on the wall clock, for the simulated vLLM server (`server.py`).

`RealtimeEngine` steps the simulator's `EngineSim` (continuous batching, chunked prefill, KV
blocks, recompute preemption; step time from the batch latency model) with an asyncio task, so
token timing reacts to load as a real engine's does. `FixedLatencyEngine` answers with a fixed
TTFT and time between tokens whatever the load (what a proxy adds then shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time

from slogate.router.latency import DEFAULT_PROFILE, PROFILES, BatchLatencyModel, LatencyCoeffs
from slogate.router.prefix import BLOCK_CHARS
from slogate.router.request import SLO
from slogate.router.request import Request as CoreRequest
from slogate.sim.engine import EngineSim, Seq

_SLO = SLO.best_effort()


class RealtimeEngine:
    """EngineSim stepped on the wall clock. `time_scale` > 1 slows it down (e.g. to make a
    fast profile saturate at a rate a test can produce)."""

    def __init__(self, profile: str | LatencyCoeffs = DEFAULT_PROFILE, max_num_seqs: int = 64, max_batched_tokens: int = 512,
                 kv_capacity_tokens: int = 400_000, time_scale: float = 1.0, priority_scheduling: bool = False) -> None:
        coeffs = PROFILES[profile] if isinstance(profile, str) else profile  # a named profile or fitted coefficients
        self.eng = EngineSim(0, BatchLatencyModel(coeffs), max_num_seqs, max_batched_tokens, kv_capacity_tokens)
        self.time_scale = time_scale
        self.priority_scheduling = priority_scheduling
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue[int | None]] = {}
        self._prio: dict[int, tuple[int, int]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.aborted = 0
        self.finished = 0
        self.peak = 0  # most requests ever in the engine at once (running + waiting)
        # vLLM's own latency histograms, as sums and counts: first tokens from arrival here, and each
        # finished request's mean time per output token (what bench/real_engines.py reads of vLLM).
        self.ttft_sum = self.tpot_sum = 0.0
        self.ttft_count = self.tpot_count = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def running(self) -> int:
        return len(self.eng.running)

    @property
    def waiting(self) -> int:
        return len(self.eng.waiting)

    @property
    def kv_usage(self) -> float:
        e = self.eng
        return 1.0 - e.free_blocks / max(e.total_blocks, 1)

    def submit(self, prompt_tokens: int, out_tokens: int, priority: int = 0, prefix: tuple[int, ...] = (),
               chars_per_token: float = 4.0) -> tuple[int, asyncio.Queue[int | None]]:
        rid = next(self._ids)
        q: asyncio.Queue[int | None] = asyncio.Queue()
        self._queues[rid] = q
        creq = CoreRequest(rid, time.monotonic(), max(prompt_tokens, 1), _SLO, prefix=prefix, tokens_per_block=BLOCK_CHARS / chars_per_token)
        seq = Seq(creq, max(out_tokens, 1))
        if self.priority_scheduling:
            key = (priority, rid)
            self._prio[rid] = key
            w = self.eng.waiting
            pos = next((i for i, s in enumerate(w) if self._prio.get(s.req.rid, (0, 0)) > key), len(w))
            w.insert(pos, seq)
        else:
            self.eng.add(seq)
        self.peak = max(self.peak, len(self.eng.running) + len(self.eng.waiting))
        self._wake.set()
        return rid, q

    def abort(self, rid: int) -> None:
        if self._queues.pop(rid, None) is not None and self.eng.abort(rid) is not None:
            self.aborted += 1
        self._prio.pop(rid, None)

    async def _run(self) -> None:
        eng = self.eng
        while True:
            dt = eng.start_step(time.monotonic())
            if dt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(dt * self.time_scale)
            now = time.monotonic()
            for s in eng.finish_step():
                rid = s.req.rid
                s.req.generated += 1
                if s.req.generated == 1:
                    s.req.first_token_at = now
                    self.ttft_sum += now - s.req.arrival
                    self.ttft_count += 1
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(s.req.generated)
                if s.req.generated >= s.true_len:
                    eng.remove(s)
                    if s.req.generated > 1 and s.req.first_token_at is not None:
                        self.tpot_sum += (now - s.req.first_token_at) / (s.req.generated - 1)
                        self.tpot_count += 1
                    self._prio.pop(rid, None)
                    if self._queues.pop(rid, None) is not None:
                        q.put_nowait(None)  # type: ignore[union-attr]
                        self.finished += 1


class FixedLatencyEngine:
    """Each request on its own timer: first token after `ttft_s`, then one every `itl_s`,
    whatever the load — the yardstick for measuring what a proxy adds (like guidellm's mock
    server). Same interface as RealtimeEngine."""

    def __init__(self, ttft_s: float, itl_s: float, priority_scheduling: bool = False, jitter: float = 0.0,
                 stall_p: float = 0.0, stall_s: float = 0.0, seed: int = 0) -> None:
        """`jitter`: each gap is itl·(1 ± jitter), uniform; `stall_p`: the chance that a gap
        is a stall of `stall_s` instead (another request's prefill, a preemption)."""
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.jitter, self.stall_p, self.stall_s = jitter, stall_p, stall_s
        self.rng = random.Random(seed)
        self.priority_scheduling = priority_scheduling
        self._ids = itertools.count()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.eng = EngineSim(0, BatchLatencyModel(PROFILES[DEFAULT_PROFILE]))  # for the preemption counter only
        self.aborted = 0
        self.finished = 0
        self.peak = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()

    @property
    def running(self) -> int:
        return len(self._tasks)

    waiting = 0
    kv_usage = 0.0

    def submit(self, prompt_tokens: int, out_tokens: int, priority: int = 0, prefix: tuple[int, ...] = (),
               chars_per_token: float = 4.0) -> tuple[int, asyncio.Queue[int | None]]:
        rid = next(self._ids)
        q: asyncio.Queue[int | None] = asyncio.Queue()

        self.peak = max(self.peak, len(self._tasks) + 1)

        async def emit() -> None:
            loop = asyncio.get_running_loop()
            t = loop.time() + self.ttft_s
            for i in range(1, max(out_tokens, 1) + 1):
                await asyncio.sleep(max(t - loop.time(), 0))
                q.put_nowait(i)
                t += self.stall_s if self.rng.random() < self.stall_p else self.itl_s * (1 + self.jitter * (2 * self.rng.random() - 1))
            q.put_nowait(None)
            self._tasks.pop(rid, None)
            self.finished += 1

        self._tasks[rid] = asyncio.get_running_loop().create_task(emit())
        return rid, q

    def abort(self, rid: int) -> None:
        t = self._tasks.pop(rid, None)
        if t is not None and not t.done():
            t.cancel()
            self.aborted += 1
