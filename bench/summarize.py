"""Markdown tables and acceptance ratios from `slogate simulate` JSON.

    python bench/summarize.py bench/results/trace_azure2023_conv-mean.json [--baseline fcfs+least-load]
"""

from __future__ import annotations

import argparse
import json


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--ours", default="gmax+gorouting")
    ap.add_argument("--baseline", default="fcfs+least-load")
    args = ap.parse_args()
    with open(args.results) as f:
        rows = json.load(f)["results"]
    print("| load | policy | token goodput/s | non-compound goodput/s | req goodput/s | TDG | att latency | att deadline | att compound | att all | TTFT p50 | TBT p95 | shed | preempted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        a, by = r["slo_attainment"], r.get("token_goodput_by_class", {})
        nc = sum(v for k, v in by.items() if k != "compound")
        print(f"| x{r['rate_scale']:g} | {r['name']} | {r['token_goodput']:,.0f} | {nc:,.0f} | {r['request_goodput']:.1f} | {pct(r['tdg_ratio'])} | "
              f"{pct(a.get('latency'))} | {pct(a.get('deadline'))} | {pct(a.get('compound'))} | {pct(a.get('all'))} | "
              f"{r['ttft_p50']:.2f} | {r['tbt_p95']:.3f} | {r['shed']} | {r['preempted']} |")
    print()
    print("| load | baseline att all | ours / baseline (all) | ours / best other (all) | ours / baseline (non-compound) | ours / best other (non-compound) | best other (non-compound) | bound | bound / baseline | ours / bound |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for s in sorted({r["rate_scale"] for r in rows}):
        at = {r["name"]: r for r in rows if r["rate_scale"] == s}
        ours, base = at[args.ours], at[args.baseline]

        def nc(r):
            return sum(v for k, v in r.get("token_goodput_by_class", {}).items() if k != "compound")

        others = [r for n, r in at.items() if n != args.ours]
        best_all = max(others, key=lambda r: r["token_goodput"])
        best_nc = max(others, key=nc)
        print(f"| x{s:g} | {pct(base['slo_attainment']['all'])} | {ours['token_goodput'] / base['token_goodput']:.2f} | "
              f"{ours['token_goodput'] / best_all['token_goodput']:.2f} ({best_all['name']}) | {nc(ours) / nc(base):.2f} | "
              f"{nc(ours) / nc(best_nc):.2f} | {best_nc['name']} | {bound_cols(ours, base)}")


def bound_cols(ours: dict, base: dict) -> str:
    """The isolation bound (`sim/bounds.py`): the most any policy could earn, so bound/baseline
    is the largest ratio over the baseline that is reachable at all."""
    b = ours.get("ideal_token_goodput")
    if not b:
        return "- | - | - |"
    return f"{b:,.0f} | {b / base['token_goodput']:.2f} | {ours['token_goodput'] / b:.0%} |"


if __name__ == "__main__":
    main()
