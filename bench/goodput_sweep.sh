#!/usr/bin/env bash
# Goodput vs load for every policy combination on one trace (docs/benchmarks.md).
# Usage: bench/goodput_sweep.sh TRACE RATE_SCALES [PREDICTOR] [OUT]
set -euo pipefail
D="${SLOGATE_DATA:-$(dirname "$0")/../../shared/data}"
TRACE="$1"; RATES="$2"; PRED="${3:-mean}"; OUT="${4:-bench/results/$(basename "$TRACE" .csv)-$PRED.json}"
POLICIES="${POLICIES:-gmax+gorouting,fcfs+least-load,fcfs+gorouting,edf+least-load,sjf+least-load,ltr+least-load,plas+least-load,slide+gorouting,priority+least-load,vtc+least-load,sa+least-load,gmax+pok}"
slogate simulate --trace "$D/$TRACE" --workflows "$D/workflows_chatdev.jsonl" \
  --mix latency=1,deadline=1,compound=1 --tiers high=2:0.5,low=1:0.5 --replicas 8 \
  --max-requests "${MAX_REQUESTS:-10000}" --rate-scale "$RATES" --policies "$POLICIES" \
  --predictor "$PRED" --seed 0 --out "$OUT" --plot "${OUT%.json}.png" \
  ${STAGE_ESTIMATE:+--stage-estimate "$STAGE_ESTIMATE"}
