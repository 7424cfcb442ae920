#!/usr/bin/env bash
# The GPU run in named steps: GPU tests, the recipe benchmark, the fused-loss benchmark, shipped-
# config acceptance and a profile. Each step fits one device call (600 s at most; times below are
# on one H200). A warm machine keeps /tmp between calls, so later steps reuse the checkpoints and
# compile caches of earlier ones; a fresh machine builds them again.
#
#   BENCH_COMMIT=<git rev-parse --short HEAD, run here> bash scripts/gpu_session.sh STEP [STEP...]
#
# The machine: python3.12 and torch 2.11 preinstalled, no network. The other wheels travel in a
# carried .whl/ folder (bash ../shared/device/wheels.sh pytest pluggy iniconfig pytest-xdist
# execnet packaging liger-kernel==0.8.5 cut-cross-entropy==25.1.1; the shipped* steps also need
# bitsandbytes==0.50.2, 43 MB, a manylinux_2_24 wheel that wheels.sh's platforms miss: pip
# download it with --platform manylinux_2_24_x86_64; torchtune's full configs use its
# PagedAdamW8bit).
# `tune` is not on PATH there: everything runs as `python3 -m tune_recipes` or a script.
# Results: $OUT/<step>.json, .md, .png and <step>_logs.tgz; at most 8 files come back a call,
# so run one step a call.
#
#   tests      the library's GPU tests (pytest -m gpu, tests/unit; fused-loss kernels, FP8,
#              collate, document attention, the 8-bit optimizer)     (both together ran past 5.5 min: a call each)
#   rtests     the recipes' GPU tests (tests/recipes: FP8 recipes, padding-free on CUDA): longer
#              than the step's 540 s; run it in two, PYTEST_K=fp8 then PYTEST_K='not fp8'
#   packed1b   Llama-3.2-1B full fine-tune on packed instruction rows: stock's best vs
#              ours' README fastest settings, 2 alternating repetitions                 ~7 min
#   padded1b   the same on unpacked rows, padded per batch as shipped, 1 repetition (a
#              compiled run may recompile for new batch lengths: 300 s a run at most)    ~7 min
#   packed8b   Llama-3.1-8B LoRA, packed (first builds the 8B checkpoint, ~2.5 min)      ~8 min
#   padded8b   Llama-3.1-8B LoRA, padded                                                 ~5 min
#   qlora8b    QLoRA's purpose, packed: stock's NF4 QLoRA vs ours' FP8 base              ~5 min
#   packs      1B packed: stock's best, ours' packed settings (packs without their padding), the
#              same computing each pack's padding, and saving 70% of activations         ~6 min
#   hostbound  ours' 4-row unpacked 1B step as shipped, with its host stacks
#              sampled (scripts/host_samples.py prints the shares), and with one dataloader
#              worker, 80 steps (ONLY=...: ours_cpp_wrapper, Inductor's C++ wrapper;
#              ours_gpu_busy, a 30 ms sleep kernel queued before each step)             ~7 min
#   rows16     ours' 1B step on packed rows and on unpacked rows 16 a step (about a packed step's
#              examples and tokens): the per-token rate with the step's fixed cost spread alike ~5 min
#   fp8curves  1B packed, 220 steps: stock's best against the packed settings with FP8 products
#              alone (tensorwise, then rowwise), the loss gap of each (ONLY=... other variants) ~6 min
#   reference  full-length synthetic rows (the claim preset): 1B full, 2 repetitions     ~6 min
#   reference8b  the same: 8B LoRA and QLoRA, 1 repetition (after an 8B step: its checkpoint) ~6 min
#   shipped1b  Llama-3.2 1B/3B single-device configs as shipped, ours vs torchtune's     ~7 min
#   shipped8b  the Llama-3.1-8B LoRA config as shipped                                   ~5 min
#   shippedq8b the Llama-3.1-8B QLoRA config as shipped                                  ~5 min
#   shipped    CASES=shipped:<config>,... as shipped, ours vs torchtune's (default: the 3B full
#              config; a run of a small model ~1 min, an 8B/7B one ~2, plus its checkpoint once;
#              shipped:llama3_2/8B_to_1B_kd_single_device against torchtune's
#              8B_to_1B_KD_lora_single_device also builds the 8B teacher's checkpoint, ~2.5 min);
#              ours_no_ac: activation checkpointing off, where a config turns it on;
#              ONLY=stock,ours,ours_compiled,ours_packed: what compile and packing buy each config;
#              ours_ac_every_2: checkpointing every second layer (where ours checkpoints every one);
#              ours_ac_non_reentrant, ours_torchtune_rope, ours_torchtune_rms_norm,
#              ours_torchao_nf4 (QLoRA): each eager-path change undone alone, an A/B against
#              ours (docs/configs.md, eager steps)
#   fused      the fused linear + cross-entropy benchmark against its peers              ~5 min
#   optim      the optimizer step alone at Llama-3.2-1B's shapes, after backward: torch's
#              AdamW and our AdamW8bit as compile_optimizer_step builds them, then AdamW8bit
#              uncompiled (one compiled call a parameter); host and synchronized ms a step and
#              the first step (the compile)                                               ~4 min
#   attention  attention alone on packed rows (scripts/bench_attention.py): flex on the block
#              mask against flash over document spans, the 1B and a head-dim-128 shape   ~1 min
#   accept     shipped-config acceptance, single device: Llama-3.2 1B/3B, Qwen2.5 0.5B/1.5B ~8 min
#   accept8b   the same: Llama-3.1-8B and the 8B-to-1B distillation                      ~7 min
#   accept7b   the same: Qwen2.5-7B                                                      ~5 min
#   daccept    distributed configs on 2 GPUs (the nvidia-h200-x2 kind): Llama-3.2 1B/3B ~7 min
#   daccept8b  the same: Llama-3.1-8B and the 8B-to-1B distillation                      ~8 min
#   daccept7b  the same: Qwen2.5-7B                                                      ~6 min
#   profile    each side's best 1B step on packed rows under torch.profiler (3 steps after the
#              clock's warm-up), by kernel kind and by what the GPU waited on (its tokens/s
#              include the profiler: not a speed row; CASE=full_1b_padded: unpacked rows)  ~6 min
# REPS=N changes the benchmark steps' repetitions; ONLY=a,b runs only those variants, each every
# repetition (an A/B of a lever: ONLY=ours,ours_default_allocator REPS=2);
# BENCH_ARGS="--env TORCH_LOGS=recompiles" adds arguments to scripts/bench_recipes.py;
# BENCH_ARGS="--window 60": a longer timed window (less run-to-run spread, more device time).
# BENCH_ARGS="--env BENCH_MEMORY_AT_PEAK=1": each run's memory at its peak, by where it was
# allocated, in its .clock.json.memory.txt (in the logs; not a speed row: it records stacks).
# A+B runs step A on GPU 0 and step B on GPU 1
# at once (the nvidia-h200-x2 kind; 8 files come back: two benchmark steps), e.g. packed1b+packed8b.
set -uo pipefail
[ -n "${ONE_OF_TWO:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
# No network there: the instruction rows load from a local JSON, and nothing waits on the hub.
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
W=/tmp/bw  # checkpoints, data, configs and logs, shared by every step
mkdir -p "$OUT" "$W"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, torchtune, torchao; print('torch', torch.__version__, 'triton',
triton.__version__, 'torchtune', torchtune.__version__, 'torchao', torchao.__version__)" 2>&1 | grep -v Skipping
  df -h /tmp | tail -1
  # The host: an eager or small-batch step waits on it, so its speed is part of the result.
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
       "load $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$W/machine.txt"
cat "$W/machine.txt"

# bench NAME ARGS...: one scripts/bench_recipes.py run (540 s at most, 300 s a run; a run cut
# short keeps the rows before it in NAME.json), its table printed and its logs kept.
bench() {
  local name=$1 args=(); shift
  while [ $# -gt 0 ]; do  # ONLY=...: the named variants of the step's cases, preset or not
    if [ -n "${ONLY:-}" ] && [ "$1" = --preset ]; then shift 2; else args+=("$1"); shift; fi
  done
  timeout "${BENCH_TIMEOUT:-540}" python3 scripts/bench_recipes.py --work $W --run-timeout 300 \
    --out "$OUT/$name.json" ${ONLY:+--only "$ONLY"} ${BENCH_ARGS:-} "${args[@]}" > "$W/$name.log" 2>&1
  echo "bench_recipes.py exit $?"
  grep -h "^|\|^loss\|^checkpoint\|rror" "$W/$name.log" | cut -c1-300
  tar czf "$OUT/${name}_logs.tgz" "$W/machine.txt" "$W/$name.log" "$W"/*_rep*.log "$W"/*_rep*.yaml \
    "$W"/*.clock.json "$W"/*.memory.txt 2>/dev/null
}
# accept NAME KIND CONFIGS: scripts/gpu_acceptance.py over the configs matching CONFIGS
# (comma-separated shell patterns), 5 steps each, its checkpoints shared with the benchmarks.
accept() {
  timeout 540 python3 scripts/gpu_acceptance.py --kind "$2" --nproc 2 --steps 5 --configs "$3" \
    --work $W --out "$OUT/$1.json" 2>&1 | grep -v "^{" | tail -30
  tar czf "$OUT/$1_logs.tgz" -C $W machine.txt logs configs 2>/dev/null
}

for step in "$@"; do
  echo "=== $step"
  # The runs' output folders (an 8B run's epoch checkpoint is 16 GB: two steps' fill the 64 GB
  # disk); the checkpoints they start from (ckpt_*) and their logs stay.
  [ -n "${ONE_OF_TWO:-}" ] || find "$W" -mindepth 1 -maxdepth 1 -type d -name '*_rep[0-9]*' -exec rm -rf {} +
  if [[ $step == *+* ]]; then  # A+B: one step a GPU, at once
    CUDA_VISIBLE_DEVICES=0 ONE_OF_TWO=1 bash "$0" "${step%%+*}" > "$W/gpu0.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 ONE_OF_TWO=1 bash "$0" "${step#*+}" > "$W/gpu1.out" 2>&1
    wait; cat "$W/gpu0.out" "$W/gpu1.out"; continue
  fi
  case $step in
    tests|rtests)  # the report grows in $OUT as tests finish: a call cut short keeps it
               dir=tests/unit; [ "$step" = rtests ] && dir=tests/recipes
               files=$(grep -rlE "pytest.mark.gpu|mark\.gpu" $dir --include="*.py")
               [ -n "$files" ] || { echo "no GPU tests under $dir"; exit 2; }
               # PYTEST_K=expr: a subset (rtests runs past the 540 s below)
               timeout 540 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -v -rfE --durations=10 \
                 ${PYTEST_K:+-k "$PYTEST_K"} $files > "$OUT/$step.txt" 2>&1
               echo "pytest exit $?" | tee -a "$OUT/$step.txt"
               grep -E "PASSED|FAILED|ERROR|passed|failed|s call" "$OUT/$step.txt" | cut -c1-200 | tail -40 ;;
    packed1b)  bench packed1b --preset instruct --cases full_1b_packed --reps "${REPS:-2}" ;;
    padded1b)  bench padded1b --preset instruct --cases full_1b_padded --reps "${REPS:-1}" ;;
    packed8b)  bench packed8b --preset instruct --cases lora_8b_packed --reps "${REPS:-1}" ;;
    padded8b)  bench padded8b --preset instruct --cases lora_8b_padded --reps "${REPS:-1}" ;;
    qlora8b)   bench qlora8b --preset instruct --cases qlora_8b_packed --reps "${REPS:-1}" ;;
    packs)     bench packs --cases full_1b_packed --reps 1 \
                 --only "${ONLY:-stock_best,ours_best,ours_pack_padding,ours_budget_07}" ;;
    hostbound) bench hostbound --cases full_1b_padded --steps 80 --reps 1 \
                 --only "${ONLY:-ours_best,ours_host_samples,ours_loader_worker}"
               python3 scripts/host_samples.py "$OUT/hostbound.json" --top 45 > "$OUT/hostbound_samples.md" 2>&1
               head -c 6000 "$OUT/hostbound_samples.md" ;;
    rows16)    bench rows16 --cases full_1b_packed,full_1b_padded_16 --reps 1 --only "${ONLY:-ours_best}" ;;
    fp8curves) bench fp8curves --cases full_1b_packed --steps 220 --reps 1 \
                 --only "${ONLY:-stock_best,ours_fp8_plain,ours_fp8_rowwise}" ;;
    reference) bench reference --preset claim --cases full_1b --reps "${REPS:-2}" ;;
    reference8b) bench reference8b --preset claim --cases lora_8b,qlora_8b --reps "${REPS:-1}" ;;
    shipped1b) bench shipped1b --preset shipped --reps "${REPS:-1}" --cases \
                 shipped:llama3_2/1B_full_single_device,shipped:llama3_2/1B_lora_single_device,shipped:llama3_2/3B_lora_single_device ;;
    shipped8b) bench shipped8b --preset shipped --reps "${REPS:-1}" --cases shipped:llama3_1/8B_lora_single_device ;;
    shippedq8b) bench shippedq8b --preset shipped --reps "${REPS:-1}" --cases shipped:llama3_1/8B_qlora_single_device ;;
    shipped)   bench shipped --preset shipped --reps "${REPS:-1}" --cases "${CASES:-shipped:llama3_2/3B_full_single_device}" ;;
    attention) timeout 300 python3 scripts/bench_attention.py --out "$OUT/attention_1b.json" 2>&1 | grep -v Skipping | tail -6
               timeout 200 python3 scripts/bench_attention.py --rows 2 --head-dim 128 \
                 --out "$OUT/attention_hd128.json" 2>&1 | grep -v Skipping | tail -4 ;;
    fused)     timeout 540 python3 scripts/bench_fused_ce.py --out "$OUT/fused.json" > "$W/fused.log" 2>&1
               echo "bench_fused_ce.py exit $?"; grep -h "^|\|rror" "$W/fused.log" | cut -c1-200 ;;
    optim)     for compiled in --compiled ""; do
                 timeout 270 python3 scripts/bench_optimizer_host.py --after-backward $compiled \
                   --model torchtune.models.llama3_2.llama3_2_1b --passes 1 \
                   --optimizers "torch.optim.AdamW,tune_recipes.optim.AdamW8bit" \
                   --out "$OUT/optim${compiled:+_compiled}.json" 2>&1 | grep -v Skipping | tail -4
               done ;;
    accept)    accept accept single "llama3_2/1B_*,llama3_2/3B_*,qwen2_5/0.5B_*,qwen2_5/1.5B_*" ;;
    accept8b)  accept accept8b single "llama3_1/*,llama3_2/8B_to_1B_*" ;;
    accept7b)  accept accept7b single "qwen2_5/7B_*" ;;
    daccept)   accept daccept distributed "llama3_2/1B_*,llama3_2/3B_*" ;;
    daccept8b) accept daccept8b distributed "llama3_1/*,llama3_2/8B_to_1B_*" ;;
    daccept7b) accept daccept7b distributed "qwen2_5/7B_*" ;;
    profile)   bench profile --cases "${CASE:-full_1b_packed}" --only "${ONLY:-stock_best,ours_best}" --reps 1 --profile
               # every variant profiled (ONLY=a,b: each summarized, in that order)
               traces=(); IFS=, read -ra variants <<< "${ONLY:-stock_best,ours_best}"
               for v in "${variants[@]}"; do traces+=("$W/prof_${CASE:-full_1b_packed}_${v}_rep0"); done
               python3 scripts/trace_summary.py "${traces[@]}" > "$OUT/profile_kernels.txt" 2>&1
               cut -c1-160 "$OUT/profile_kernels.txt" | head -120 ;;
    *)         echo "unknown step $step (steps: see the header of $0)"; exit 2 ;;
  esac
done
