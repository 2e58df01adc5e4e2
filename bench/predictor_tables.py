"""Markdown tables for docs/benchmarks.md from bench/results/predictor_*.json."""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).parent / "results"
KEYS = ["n_at_0", "coverage_at_0", "mean_ratio_at_0", "p50_ratio_at_0", "pinball_at_0", "coverage_at_100", "mean_ratio_at_100",
        "mean_total_ratio_at_100", "coverage_at_200", "mean_total_ratio_at_200"]


def length_table() -> str:
    r = json.loads((R / "predictor_eval.json").read_text())
    out = ["| set | bound | " + " | ".join(KEYS) + " |", "|---|---|" + "---|" * len(KEYS)]

    def row(src: str, name: str, d: dict) -> None:
        out.append(f"| {src} | {name} | " + " | ".join(str(d.get(k, "")) for k in KEYS) + " |")

    row("all", "**qrf**", r["model"])
    for b, d in r["baselines"].items():
        row("all", b, d)
    for s, d in r["by_source"].items():
        row(s, "**qrf**", d)
        for b, bd in d["baselines"].items():
            row(s, b, bd)
    return "\n".join(out)


def graph_table() -> str:
    r = json.loads((R / "predictor_graphs.json").read_text())
    out = ["| workflows | method | φ(s) MAE | next-stage share MAE | share MAE by stages revealed |", "|---|---|---|---|---|"]
    for f, d in r["files"].items():
        for m in ("pattern", "uniform", "jitserve_code"):
            by = ", ".join(f"{b}: {v['share_mae']}" for b, v in d[m]["by_revealed_stages"].items())
            out.append(f"| {f} ({d['workflows']}) | {m} | {d[m]['all']['phi_mae']} | {d[m]['all']['share_mae']} | {by} |")
    lat = r["match_latency_500"]
    out.append(f"\nMatching with {lat['graphs']} stored graphs: p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms.")
    return "\n".join(out)


def sim_table() -> str:
    out = ["| predictor | policy | token goodput | request goodput | TDG ratio | attainment all | first-bound coverage | first-bound mean ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for p in ("qrf", "mean", "oracle"):
        f = R / f"predictor_sim_{p}.json"
        if not f.exists():
            continue
        for row in json.loads(f.read_text())["results"]:
            out.append(f"| {p} | {row['name']} | {row['token_goodput']:.0f} | {row['request_goodput']:.2f} | {row['tdg_ratio']:.3f} | "
                       f"{row['slo_attainment']['all']:.3f} | {row.get('predictor_coverage_at_0', '')} | {row.get('predictor_mean_ratio_at_0', '')} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(length_table(), "\n")
    print(graph_table(), "\n")
    print(sim_table())
