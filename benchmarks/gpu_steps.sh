#!/usr/bin/env bash
# The GPU measurements of benchmarks/results/README.md as named steps, each bounded by `timeout`, run from the
# repository root on a GPU host; files land in $OUT (default /tmp/out).
#   INSTALL='pip install -e .[gpu,test]' bash benchmarks/gpu_steps.sh COMMIT STEP...
# INSTALL: a command that makes the package and its GPU dependencies importable on this host (default: none, they
# already are); EXTRA_PYTHONPATH: folders put before the checkout on PYTHONPATH; COMMIT: recorded as GIT_COMMIT
# where the tree has no .git; TIME_S: the wall-clock seconds the whole run may take (default 570), which the sweep
# and confirm steps divide among themselves.
#   STEP: graphs | sweep=N | proxy=N | s1664=N | fused=N | packed=N | confirm=STUDY | h100packing | baseline |
#         gputests | census | mbs64 | fusions | mbs96 | packing | imports | pack | h100packed=N | trialcost | probes |
#         firststep | kernelwall | kernelwall_proxy
#   Every step but gputests, h100packing, h100packed, trialcost, probes, firststep, kernelwall, imports and pack needs
#   an H200's memory:
#   on a smaller card the script stops before them rather than run out of memory or mix machines in one study;
#   h100packed needs an H100 (80 GB): its study is that card's alone.
#   graphs    every CUDA-graph scope against eager on model=small (3D, MBS 32, 1664 decoder tokens), with TE's
#             attention-backend log, and the 1599-token attn config the worker's preflight must reject
#   sweep=N   the h200_single sweep (Optuna + MLflow on SQLite under outputs/) up to N trials; resumes. It gets
#             the time left (TIME_S less 30 s for pack) as sweep.time_budget_s, so it stops between trials and
#             confirms only when the re-runs fit
#   proxy=N   the same for h200_proxy (model=qwen3_vl_30b_a3b_proxy)
#   s1664=N   the same for h200_small_s1664 (model=small, 3D, 1664 decoder tokens, MBS 32-96, GBS 192)
#   fused=N   the same for h200_small_fused (s1664 with the fused SwiGLU and the unfused loss, MBS 64-96)
#   packed=N  the same for h200_small_packed (h200_small_fused at GBS 384 with and without data.packing and the
#             allocator's expandable segments, MBS 96-128)
#   confirm=STUDY  best --confirm: the top 3 trials re-run twice each, the one whose median holds is exported,
#             within the time left; re-runs that do not fit are left for the next confirm=STUDY, which reuses the
#             finished ones
#   gputests  the GPU-only tests of graphs and fusions (tests/test_gpu_graphs.py: graph scopes and packed THD rows
#             train like eager, eager runs a census; tests/test_gpu_wgrad_fusion.py: TE's weight-gradient fusion
#             without APEX trains like the unfused run); gputests=EXPR runs those pytest -k EXPR selects
#   census    eager 3D MBS 32 and 64 at 1664 tokens: each run's saved-tensor census (saved_tensors.txt, metrics'
#             saved_activations) next to the memory estimate's parts
#   mbs64     eager, attn_moe_router and layer_te at MBS 64 (3D, 1664 decoder tokens): does a larger batch lift MFU
#   fusions   megatron's fused SwiGLU (fusions.bias_activation) and fused router (fusions.moe_router) against
#             unfused, alone and together, at MBS 64 (eager, 3D, 1664 tokens), then both at MBS 96
#   mbs96     MBS 64 (eager, GBS 192) against MBS 96 with the fused SwiGLU and the unfused loss, which take back
#             the expert activations' copies and the loss's fp32 logits (plan/memory.py)
#   packing   packed micro-batches past MBS 96: packed MBS 96, 112 and 128 (eager, fused SwiGLU, unfused loss;
#             two micro-batches a step each)
#   h100packing  packed against padded rows at MBS 48-64 with hardware=h100, on an H100 (80 GB)
#   baseline  the FSDP baseline (FSDP, MBS 8, eager) next to 3D MBS 32
#   imports   python -X importtime of the worker's heavy imports, and their time with and without skip_jax
#   h100packed=N  the h100_small_packed sweep (the H100's own space: GBS 192, packed and padded rows, the fused
#             loss against the unfused one) up to N trials, as sweep=N
#   trialcost benchmarks/trial_cost.py's GPU configs, before against now (about 100 s a `before` trial, 30 s a
#             `now` one), on this card's hardware group
#   probes    trial_cost.py's fusion probes alone, two rounds (the first fills the compile caches)
#   firststep what a trial's first step pays that later steps do not: trial_cost.py's MBS 48 config as a sweep runs
#             it now, with and without megatron's fused SwiGLU (fusions.bias_activation, torch.compile'd by
#             megatron.core.jit.jit_fuser), alternating, two rounds (the first fills the compile caches), each first
#             step traced (train.trace_first_step); each run's first_step_host_ops.txt and first_step_kernels.txt
#             land in $OUT (a run without them leaves its worker log's end); about 40 s a trial
#   kernelwall  this card's best config (kernel_wall.py's preset) against the plain training loop of the same
#             recipe, alternating, three runs each (about 40 s a run; the best config's first run about 90 s,
#             its compile caches empty): give it TIME_S of at least 420
#   kernelwall_proxy  the same for model=qwen3_vl_30b_a3b_proxy (kernel_wall.py --model): the preset's H200
#             candidate for the proxy's recipe (GBS 8) against the plain loop at the h200_proxy study's MBS 4
#   pack      outputs/ (with its exported experiments) and the step folders as $OUT/outputs.tgz
set -u
[[ -z ${INSTALL:-} ]] || eval "$INSTALL" >/dev/null || exit 1
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=$1
shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TIME_S=${TIME_S:-570}
left() { echo $((TIME_S - SECONDS)); }
C="model=small hardware=h200 batch.gbs=32 train.warmup_steps=3 train.steps=8 train.timeout_s=100 recompute=none vision=trainable dispatcher=alltoall"
D="dispatcher.capacity_factor=1.0 dispatcher.pad_to_capacity=true"
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
for step in "$@"; do
  case "$step" in
    gputests*|h100packing|imports|pack|trialcost|probes|firststep|kernelwall) ;;
    h100packed=*) nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 ||
      { echo "step $step is the H100's study; this card is $(nvidia-smi --query-gpu=name --format=csv,noheader)" >&2; exit 2; } ;;
    *) (( mem_mib > 100000 )) || { echo "step $step needs an H200; this card has ${mem_mib} MiB" >&2; exit 2; } ;;
  esac
done
HW=h100; (( mem_mib > 100000 )) && HW=h200
S="model.text_tokens=1089"  # 1664 decoder tokens, a multiple of 128 (1599 is not): TE's cuDNN graph-capture rule
# A worker a timeout orphaned must not share the GPU. "[m]" keeps the pattern from matching a shell whose own
# command line holds it.
stop_orphans() { pkill -f "[m]oe_vlm_sweep.train.worker"; sleep 2; }
for step in "$@"; do
  case "$step" in
    graphs)  # every graph scope against eager at 1664 decoder tokens (a multiple of 128, so TE keeps fused attention
             # under capture on cuDNN <= 9.15), 3D MBS 32, after the 1599-token attn config that preflight must reject;
             # about 70 s a config
      NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 520 python3 benchmarks/compare_configs.py --outputs /tmp/graphs \
        --out "$OUT/h200_graphs.json" --common "$C parallel=3d batch.mbs=32 $S" \
        --config attn_1599="cuda_graph=attn model.text_tokens=1024" \
        --config eager="cuda_graph=none" --config attn="cuda_graph=attn" \
        --config attn_moe_router="cuda_graph=attn_moe_router" \
        --config attn_moe_router_preprocess="cuda_graph=attn_moe_router_preprocess" \
        --config layer_te="cuda_graph=layer_te $D" --config layer_local="cuda_graph=layer_local $D" \
        --config eager_droppad="cuda_graph=none $D"
      grep -h -i "disabling\|Running with .*backend" /tmp/graphs/runs/*/worker.log | sort | uniq -c | head -20
      stop_orphans ;;
    gputests|gputests=*)
      only=(); [[ $step == gputests=* ]] && only=(-k "${step#gputests=}")
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_wgrad_fusion.py \
        ${only[@]+"${only[@]}"} 2>&1 | tail -15 | tee "$OUT/gputests.txt"
      stop_orphans ;;
    census)  # about 60 s a config
      timeout 200 python3 benchmarks/compare_configs.py --outputs /tmp/census --out "$OUT/h200_census.json" \
        --common "${C/batch.gbs=32/batch.gbs=64} parallel=3d cuda_graph=none $S" \
        --config eager_mbs32="batch.mbs=32" --config eager_mbs64="batch.mbs=64"
      for run in /tmp/census/runs/*/; do cp "$run/saved_tensors.txt" "$OUT/saved_tensors_$(basename "$run").txt"; done
      stop_orphans ;;
    mbs64)  # the graphs step's best scopes at twice its batch (MBS 32 peaked at 60.5 GiB eager); about 60 s a config
      timeout 330 python3 benchmarks/compare_configs.py --outputs /tmp/mbs64 --out "$OUT/h200_mbs64.json" \
        --common "${C/batch.gbs=32/batch.gbs=64} parallel=3d batch.mbs=64 $S" \
        --config eager="cuda_graph=none" --config attn_moe_router="cuda_graph=attn_moe_router" \
        --config layer_te="cuda_graph=layer_te $D"
      stop_orphans ;;
    fusions)  # the two fusions fusions=auto leaves off until measured, one at a time and together, at MBS 64 (eager,
              # 3D, 1664 tokens; GBS = MBS, one micro-batch a step), with a kernel table of both; then both at MBS 96
              # (unfused, plan/memory.py rejects MBS 96 at 152.9 GiB); about 90 s a config
      timeout 500 python3 benchmarks/compare_configs.py --outputs /tmp/fusions --out "$OUT/h200_fusions.json" \
        --common "${C/batch.gbs=32 /} train.timeout_s=160 parallel=3d cuda_graph=none batch.mbs=64 batch.gbs=64 $S" \
        --config unfused="fusions.bias_activation=false fusions.moe_router=false" \
        --config swiglu="fusions.bias_activation=true fusions.moe_router=false" \
        --config router="fusions.bias_activation=false fusions.moe_router=true" \
        --config both="fusions.bias_activation=true fusions.moe_router=true train.trace=true" \
        --config both_mbs96="fusions.bias_activation=true fusions.moe_router=true batch.mbs=96 batch.gbs=96"
      stop_orphans ;;
    mbs96)  # GBS 192 as in h200_small_s1664: 3 micro-batches at MBS 64, 2 at MBS 96; about 100 s a config
      timeout 280 python3 benchmarks/compare_configs.py --outputs /tmp/mbs96 --out "$OUT/h200_mbs96.json" \
        --common "${C/batch.gbs=32 /} train.timeout_s=200 parallel=3d cuda_graph=none batch.gbs=192 $S" \
        --config mbs64="batch.mbs=64" \
        --config mbs96_swiglu_ce_unfused="batch.mbs=96 fusions.bias_activation=true fusions.cross_entropy=false"
      stop_orphans ;;
    sweep=*|proxy=*|s1664=*|fused=*|packed=*|h100packed=*)
      space=h200_single; [[ $step == proxy=* ]] && space=h200_proxy; [[ $step == s1664=* ]] && space=h200_small_s1664
      [[ $step == fused=* ]] && space=h200_small_fused; [[ $step == packed=* ]] && space=h200_small_packed
      [[ $step == h100packed=* ]] && space=h100_small_packed
      budget=$(( $(left) - 30 ))
      (( budget > 60 )) || { echo "skip $step: ${budget} s left"; continue; }
      timeout $((budget + 20)) python3 -m moe_vlm_sweep.cli run -m "sweep=$space" "sweep.n_trials=${step#*=}" \
        "sweep.time_budget_s=$budget" >> "$OUT/sweep.log" 2>&1
      stop_orphans
      grep -E "^\[trial|^sweep|^confirm|^best" "$OUT/sweep.log" | tail -14 ;;
    confirm=*)  # confirm=STUDY (outputs/sweeps/STUDY)
      t=$(( $(left) - 10 ))
      (( t > 60 )) || { echo "skip $step: ${t} s left"; continue; }
      timeout $t python3 -m moe_vlm_sweep.cli best "${step#confirm=}" --top 3 --confirm 2 --time-budget-s $((t - 20)) \
        >> "$OUT/confirm.log" 2>&1
      echo "best --confirm exited $? (3: re-runs left for the next confirm step)" | tee -a "$OUT/confirm.log"
      stop_orphans
      tail -12 "$OUT/confirm.log" ;;
    packing)  # about 100 s a config
      timeout 340 python3 benchmarks/compare_configs.py --outputs /tmp/packing --out "$OUT/h200_packing.json" \
        --common "${C/batch.gbs=32 /} train.timeout_s=200 parallel=3d cuda_graph=none $S data.packing=true \
          fusions.bias_activation=true fusions.cross_entropy=false" \
        --config packed_mbs96="batch.mbs=96 batch.gbs=192" --config packed_mbs112="batch.mbs=112 batch.gbs=224" \
        --config packed_mbs128="batch.mbs=128 batch.gbs=256"
      stop_orphans ;;
    h100packing)  # an H100 (80 GB): packed against padded rows on TE's THD attention at a
                  # batch that fits (padded MBS 48, packed MBS 48 and 64; GBS 192, fused SwiGLU, unfused loss,
                  # expandable segments), with TE's attention-backend log; about 70 s a config
      h100=${C/hardware=h200/hardware=h100}
      NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 300 python3 benchmarks/compare_configs.py --outputs /tmp/h100packing \
        --out "$OUT/h100_packing.json" --common "${h100/batch.gbs=32 /} train.timeout_s=150 \
          train.warmup_steps=2 train.steps=6 parallel=3d cuda_graph=none batch.gbs=192 $S \
          fusions.bias_activation=true fusions.cross_entropy=false train.expandable_segments=true" \
        --config padded_mbs48="batch.mbs=48" --config packed_mbs48="batch.mbs=48 data.packing=true" \
        --config packed_mbs64="batch.mbs=64 data.packing=true"
      grep -h -i "Running with .*backend\|disabling" /tmp/h100packing/runs/*/worker.log | sort | uniq -c | head -20
      stop_orphans ;;
    trialcost|probes)  # each trial's JSON row is written as it ends, so a step cut by its limit keeps its rows
      t=$(( $(left) - 10 ))
      (( t > 60 )) || { echo "skip $step: ${t} s left"; continue; }
      args=(--no-fusion-probes --workdir /tmp/trialcost --out "$OUT/trial_cost_$HW.json")
      [[ $step == probes ]] && args=(--probes-only --repeats 2 --workdir /tmp/probes --out "$OUT/trial_cost_probes_$HW.json")
      (cd benchmarks && timeout $t python3 trial_cost.py --hardware $HW "${args[@]}" | tail -12)
      stop_orphans ;;
    firststep)  # about 40 s a trial, the first one longer (the host's start, empty caches)
      t=$(( $(left) - 10 ))
      (( t > 60 )) || { echo "skip $step: ${t} s left"; continue; }
      (cd benchmarks && timeout $t python3 trial_cost.py --hardware $HW --only-mode now --no-fusion-probes --repeats 2 \
        --config mbs48=batch.mbs=48 --config mbs48_unfused_swiglu="batch.mbs=48 fusions.bias_activation=false" \
        --also train.trace_first_step=true --workdir /tmp/firststep \
        --out "$OUT/first_step_$HW.json" | tail -6)
      for run in /tmp/firststep/now/runs/*/; do
        name=$(basename "$run")
        [[ -f $run/first_step_host_ops.txt ]] || { tail -60 "$run/worker.log" > "$OUT/worker_tail_$name.txt"; continue; }
        for f in host_ops kernels; do cp "$run/first_step_$f.txt" "$OUT/first_step_${f}_$name.txt"; done
      done
      stop_orphans ;;
    kernelwall)
      t=$(( $(left) - 10 ))
      (( t > 60 )) || { echo "skip $step: ${t} s left"; continue; }
      (cd benchmarks && timeout $t python3 kernel_wall.py --hardware $HW --rounds 3 --outputs /tmp/kernelwall \
        --out "$OUT/kernel_wall_$HW.json" | tail -12)
      stop_orphans ;;
    kernelwall_proxy)
      t=$(( $(left) - 10 ))
      (( t > 60 )) || { echo "skip $step: ${t} s left"; continue; }
      (cd benchmarks && timeout $t python3 kernel_wall.py --model qwen3_vl_30b_a3b_proxy --hardware $HW --rounds 3 \
        --outputs /tmp/kernelwall_proxy --out "$OUT/kernel_wall_${HW}_proxy.json" | tail -12)
      stop_orphans ;;
    baseline)
      timeout 170 python3 benchmarks/compare_configs.py --outputs /tmp/baseline --out "$OUT/h200_baseline.json" \
        --common "$C" --config baseline_fsdp_mbs8="parallel=fsdp batch.mbs=8 cuda_graph=none" \
        --config 3d_mbs32="parallel=3d batch.mbs=32 cuda_graph=none"
      stop_orphans ;;
    imports)  # where a trial's 12-18 s of imports go: the 15 slowest modules, cumulative; then the chain timed
              # with jax importable and with the worker's skip_jax, alternating, twice each ($OUT/imports.txt)
      chain="import torch, transformer_engine.pytorch, megatron.core.models.multimodal.llava_model, moe_vlm_sweep.train.loop"
      python3 -X importtime -c "$chain" 2> "$OUT/importtime.txt"
      sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -15
      for run in 1 2; do
        for jax in importable skipped; do
          pre="import time; t = time.perf_counter(); "
          [[ $jax == skipped ]] && pre+="from moe_vlm_sweep.train.worker import skip_jax; skip_jax(); "
          python3 -c "$pre$chain; print('run $run, jax $jax: %.2f s' % (time.perf_counter() - t))" 2>/dev/null
        done
      done | tee "$OUT/imports.txt" ;;
    pack)
      tar czf "$OUT/outputs.tgz" --exclude=trace.json outputs /tmp/graphs /tmp/baseline /tmp/mbs64 \
        /tmp/census /tmp/fusions /tmp/mbs96 /tmp/packing /tmp/h100packing /tmp/trialcost /tmp/probes /tmp/firststep \
        /tmp/kernelwall /tmp/kernelwall_proxy 2>/dev/null ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
