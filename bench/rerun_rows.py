"""Re-run one policy combination in an existing results file (same config), replacing its rows.

    python bench/rerun_rows.py RESULTS.json [--combo gmax+gorouting] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slogate.sim.runner import Experiment, SimConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--combo", default="gmax+gorouting")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = ap.parse_args()
    path = Path(args.results)
    doc = json.loads(path.read_text())
    c = doc["config"]
    cfg = SimConfig(trace=str(Path(args.data) / c["trace"]), workflows=str(Path(args.data) / c["workflows"]) if c["workflows"] else None,
                    mix=c["mix"], tiers=c["tiers"], slo_scale=c["slo_scale"], replicas=c["replicas"], max_requests=c["max_requests"],
                    duration_s=c["duration_s"], predictor=c["predictor"], seed=c["seed"], budget=c["budget"])
    exp = Experiment(cfg)
    for i, row in enumerate(doc["results"]):
        if row["name"] == args.combo:
            exp.cfg.rate_scale = row["rate_scale"]
            new = exp.run(args.combo)
            new["rate_scale"] = row["rate_scale"]
            doc["results"][i] = new
            print(f"x{row['rate_scale']:g} {args.combo}: {row['token_goodput']:.0f} -> {new['token_goodput']:.0f}")
    path.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
