#!/usr/bin/env bash
# Length predictor and pattern-graph acceptance runs (issue 3). Writes bench/results/predictor_*.json.
# The model is trained on AlpacaEval (CC BY-NC): it stays in bench/out/ (git-ignored), never shipped.
set -euo pipefail
D=${DATA:-../shared/data}
OUT=bench/out
mkdir -p "$OUT" bench/results
ALL=$D/prompts_alpacaeval.jsonl,$D/prompts_gpteacher.jsonl,$D/prompts_gsm8k.jsonl,$D/prompts_hhrlhf.jsonl,$D/prompts_selfinstruct.jsonl

# 1. Train on 80% of the prompts of every set (split by prompt text), evaluate on the other 20%.
/usr/bin/time -f "train wall %e s, max RSS %M KB" slogate train-predictor --data "$ALL" --out $OUT/len.model --quantile 0.9 --heldout 0.2
slogate eval-predictor --model $OUT/len.model --data "$ALL" --out bench/results/predictor_eval.json

# 2. Training time on 50k rows alone.
cat $D/prompts_alpacaeval.jsonl $D/prompts_gsm8k.jsonl | head -n 50000 > $OUT/prompts_50k.jsonl || true  # head closes the pipe early
/usr/bin/time -f "train-50k wall %e s" slogate train-predictor --data $OUT/prompts_50k.jsonl --out $OUT/len50k.model --heldout 0

# 3. Pattern graphs, leave-one-out, and matching latency with 500 stored graphs.
slogate eval-graphs --workflows $D/workflows_chatdev.jsonl,$D/workflows_tot_game24.jsonl,$D/workflows_fireact_react.jsonl \
  --out bench/results/predictor_graphs.json

# 4. The predictor inside the simulator: qrf (real prompts paired by length) vs mean vs oracle.
for P in qrf mean oracle; do
  slogate simulate --trace $D/trace_azure2023_conv.csv --workflows $D/workflows_chatdev.jsonl \
    --rate-scale 20 --replicas 8 --duration-s 300 --policies gmax+gorouting,sjf+least-load,fcfs+least-load \
    --predictor $P --predictor-model $OUT/len.model --out bench/results/predictor_sim_$P.json
done

# 5. Stage sub-deadlines: whole deadline vs uniform vs pattern matching vs true shares.
for S in whole uniform pattern oracle; do
  slogate simulate --trace $D/trace_azure2023_conv.csv --workflows $D/workflows_chatdev.jsonl \
    --mix latency=1,deadline=1,compound=2 --rate-scale 16 --replicas 8 --duration-s 300 \
    --policies gmax+gorouting,edf+least-load --stage-estimate $S --out bench/results/stage_estimate_chatdev_$S.json
done
