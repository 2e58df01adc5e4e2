"""What the Redis store adds per request versus the memory store, side by side in one run.

Two fixed-latency engines, a redis-server of our own, and two `slogate serve` processes that
differ only in `state.kind`; the same closed loop of streaming clients alternates between them.

    python bench/state_overhead.py --concurrency 20 --duration 10 --repeats 3 --out bench/results/state_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_overhead import MODEL, closed_loop, spawn, wait_up

from slogate.testing.ports import free_port
from slogate.testing.procs import start_redis, stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    procs = []
    try:
        rport = free_port()
        procs.append(start_redis(rport, tmp))
        engines = []
        for _ in range(2):
            p = free_port()
            procs.append(spawn(["slogate", "engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", "20", "--fixed-itl-ms", "20"]))
            engines.append(f"http://127.0.0.1:{p}")
        for u in engines:
            wait_up(u + "/health")
        urls = {}
        for kind in ("memory", "redis"):
            cfg = tmp / f"{kind}.yaml"
            cfg.write_text("pacing: false\nbackends:\n" + "".join(f"  - {{url: {u}, models: [{MODEL}], budget: 256}}\n" for u in engines)
                           + (f"state: {{kind: redis, url: 'redis://127.0.0.1:{rport}/0'}}\n" if kind == "redis" else ""))
            port = free_port()
            procs.append(spawn(["slogate", "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"]))
            urls[kind] = f"http://127.0.0.1:{port}"
            wait_up(urls[kind] + "/health")
        runs: dict[str, list[dict]] = {"memory": [], "redis": []}
        for rep in range(a.repeats):
            for kind, u in urls.items():
                r = asyncio.run(closed_loop(f"{u}/v1/chat/completions", a.concurrency, a.duration, 16, {}, stagger=0.34))
                runs[kind].append(r)
                print(f"rep {rep} {kind:6s} {r}", flush=True)
        med = {k: float(np.median([r["ttft_p50_ms"] for r in v])) for k, v in runs.items()}
        summary = {"ttft_p50_ms": med, "redis_added_p50_ms": round(med["redis"] - med["memory"], 3)}
        print(json.dumps(summary, indent=1))
        if a.out:
            a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs, "summary": summary}, indent=1))
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
