"""A fresh gateway's first seconds in front of engines at the TBT: `slogate serve --backend A
--backend B` with every default, started anew for each repeat, in front of two fixed-latency
simulated engines (`--fixed-itl-ms`, the same pace at any batch), driven at once by a closed loop of
CONCURRENCY streaming clients that send no SLO (so the default 50 ms TBT applies). Counts the
429s: first tokens refused while the learned budgets found that a smaller batch is no faster.

    python bench/cold_start.py --repeats 5 --out bench/results/cold_start.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import closed_loop

from slogate.testing.fleet import start_engines
from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http


def one_run(a: argparse.Namespace) -> dict:
    procs, urls = start_engines(a.engines, a.ttft_ms, a.itl_ms)
    try:
        gp = free_port()
        procs.append(slogate("serve", *[x for u in urls for x in ("--backend", u)], "--port", str(gp), "--log-level", "warning"))
        wait_http(f"http://127.0.0.1:{gp}/health")
        stagger = (a.ttft_ms + a.tokens * a.itl_ms) / 1e3  # clients start over one request's length
        return asyncio.run(closed_loop(f"http://127.0.0.1:{gp}/v1/chat/completions", a.concurrency, a.duration, a.tokens, {}, stagger))
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    runs = []
    for rep in range(a.repeats):
        r = one_run(a)
        runs.append(r)
        print(f"rep {rep}: {r}", flush=True)
    doc = {"args": vars(a) | {"out": str(a.out)}, "runs": runs, "refused": [r["errors"] for r in runs]}
    print(json.dumps(doc["refused"]))
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
