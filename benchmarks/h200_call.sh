#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/device/README.md), everything side by side on one machine:
#   1. TE CUDA-graph scopes against eager on model=small (3D, MBS 32), one process each;
#   2. the h200_single sweep (Optuna + MLflow on SQLite under outputs/), resumable;
#   3. best --confirm: the top trials re-run twice each, the one whose median holds exported;
#   4. the baseline (FSDP, MBS 8, eager), for the ratio, in the same call.
# Each step is bounded so the call ends inside the device's 600 s limit; results land in $OUT.
# Usage (device tool, carrying .kit and .whl): bash benchmarks/h200_call.sh COMMIT N_TRIALS
set -u
bash .kit/install.sh .kit/kit .whl >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C="model=small hardware=h200 batch.gbs=32 train.warmup_steps=3 train.steps=8 train.timeout_s=100 recompute=none vision=trainable dispatcher=alltoall"
D="dispatcher.capacity_factor=1.0 dispatcher.pad_to_capacity=true"
timeout 150 python3 benchmarks/compare_configs.py --outputs /tmp/graphs --out "$OUT/h200_small_graphs.json" \
  --common "$C parallel=3d batch.mbs=32" --config 3d_mbs32="cuda_graph=none" --config 3d_mbs32_attn="cuda_graph=attn" \
  --config 3d_mbs32_attn_router="cuda_graph=attn_moe_router" --config 3d_mbs32_layer_local="cuda_graph=layer_local $D"
timeout 220 python3 -m moe_vlm_sweep.cli run -m sweep=h200_single "sweep.n_trials=$2" > "$OUT/sweep.log" 2>&1
pkill -f moe_vlm_sweep.train.worker; sleep 2  # a worker the timeout orphaned must not share the GPU with step 3
timeout 150 python3 -m moe_vlm_sweep.cli best --top 2 --confirm 2 > "$OUT/confirm.log" 2>&1
timeout 55 python3 benchmarks/compare_configs.py --outputs /tmp/baseline --out "$OUT/h200_baseline.json" \
  --common "$C" --config baseline_fsdp_mbs8="parallel=fsdp batch.mbs=8 cuda_graph=none"
tar czf "$OUT/outputs.tgz" outputs conf/experiment /tmp/graphs /tmp/baseline 2>/dev/null
grep -E "^\[trial|^sweep" "$OUT/sweep.log" | tail -12
tail -12 "$OUT/confirm.log"
