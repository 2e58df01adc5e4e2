"""Where slogate's prefix-hit rate goes: hits the index could see at dispatch vs hits taken.

Runs `slogate simulate` (same options) with GoRouting's placement observed: for every prompt it
dispatches, the most tokens any replica with room held (as the index knows it: in the simulator
it matches the engines' own caches) against what the chosen replica held, and why it went
elsewhere: the holder's queue would have made this request miss its first-token budget while
another replica would not (`holder_cannot`), or no replica could meet it and the earliest
first token won (`nobody_can`). One JSON line per (load, policy) run.

    python bench/prefix_hits_forgone.py --seeds 0,1,2 -- --trace ../shared/data/trace_mooncake_conversation_prefix.jsonl \
        --mix latency=1,deadline=1,compound=0 --duration-s 300 --rate-scale 0.5,1 --policies gmax+gorouting
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.router.placement import gorouting

stats: Counter[str] = Counter()
_choose = gorouting.GoRouting._choose


def observed_choose(self: gorouting.GoRouting, now, req, pool):  # type: ignore[no-untyped-def]
    target = _choose(self, now, req, pool)
    if target is None or not req.prefix:
        return target
    hits = [p.cached_tokens(req) for p in pool]
    best, took = max(hits), target.cached_tokens(req)
    stats["prompt_tokens"] += req.input_tokens
    stats["reachable"] += best
    stats["taken"] += took
    if took < best:
        deltas = [post - pre for pre, post in (self.gains(now, p, req, c) for p, c in zip(pool, hits, strict=True))]
        why = "nobody_can" if max(deltas) <= 0 else "holder_cannot"
        stats[f"{why}_n"] += 1
        stats[f"{why}_tokens"] += best - took
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("simulate", nargs=argparse.REMAINDER, help="-- then `slogate simulate` options (one --rate-scale)")
    a = ap.parse_args()
    args = [x for x in a.simulate if x != "--"]
    gorouting.GoRouting._choose = observed_choose  # type: ignore[method-assign]
    from slogate.cli import app

    for seed in a.seeds.split(","):
        stats.clear()
        with contextlib.suppress(SystemExit):
            app(["simulate", "--seed", seed, *args], standalone_mode=False)
        s = dict(stats)
        n = s.get("prompt_tokens", 0) or 1
        print(json.dumps({"seed": int(seed), "reachable_hit_rate": round(s.get("reachable", 0) / n, 4),
                          "taken_hit_rate": round(s.get("taken", 0) / n, 4), **s}), flush=True)


if __name__ == "__main__":
    main()
