#!/usr/bin/env bash
# One GPU session on the lent H200 (python 3.12, torch 2.11 preinstalled, no registry).
# Prepare wheels here first:  bash ../shared/device/wheels.sh liger-kernel==0.8.5 cut-cross-entropy==25.1.1 pytest pluggy iniconfig pytest-xdist execnet packaging
# Then run with .whl carried:  BENCH_COMMIT=<hash> bash scripts/gpu_session.sh STEP...
#   (<hash>: `git rev-parse --short HEAD` run here, written into the command: the machine's copy of
#   the tree has no .git; BENCH_COMMIT puts the commit in the results' meta)
#   (steps: tests gputests smoke dsmoke fp8smoke accept daccept profile scale fused recipes speed heads levers
#    fusedv3 fusedv4 fusedv4large fusedv5 where fp8dist offload tpsmoke fp8lora fp8lora8b curves1b fp8loramodel lag1b sac8b embcpu8b fp8mlp8b mem8b curve8b fusedv6 fusedv6large where8b qlora8b data1b ain8b final8b where1b tw8b s10a s10b s10c s10d s10e s10f s10g s10h next1b s11a s11b s11c s11d s12a s12b s12c s12d s12e s12f s13smoke s13prof s13c s14a s14b s14c s14d s14e s15a s15b s15c s15d s15e s16a s16b s16c s16d s16e s16f s16g s17a s17b s17c s17d s17e s17f s17g s17h s17i s18a s18b s18c s18d s19a s19b s19c s19d s19e fa4a fa4)
#   speed: issue #15's bench (full_1b, lora_8b); on 2+ GPUs the two cases run at once, one per GPU
#   accept: every shipped single-device config as shipped (LANES=2 on the x2 kind runs two at once)
#   daccept: every shipped distributed config on 2 GPUs (the nvidia-h200-x2 kind)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, torchtune, torchao; print('torch', torch.__version__, 'triton', triton.__version__, 'torchtune', torchtune.__version__, 'torchao', torchao.__version__)" 2>&1 | grep -v Skipping | tee -a "$OUT/gpu.txt"
# bench_on GPU CASE VARIANTS REPS NAME: one bench_recipes.py run in the background on one GPU
# (550 s at most; 300 s a run, enough for the 8B checkpoint), results in $OUT/NAME.json.
bench_on() {
  CUDA_VISIBLE_DEVICES=$1 timeout 550 python3 scripts/bench_recipes.py --cases "$2" --only "$3" --reps "$4" \
    --work /tmp/bw --run-timeout 300 --out "$OUT/$5.json" > "/tmp/speed_$5.log" 2>&1 &
}
# ensure_ckpt8b: the random-init Llama-3.1-8B checkpoint the 8B cases share, built once per machine.
ensure_ckpt8b() {
  test -f /tmp/bw/ckpt_lora_8b/model.safetensors || { mkdir -p /tmp/bw
    python3 scripts/make_random_checkpoint.py --builder torchtune.models.llama3_1.llama3_1_8b \
      --out /tmp/bw/ckpt_lora_8b > /tmp/ckpt8b.log 2>&1; }
}
# finish_bench PREFIX: the runs' logs and configs into $OUT, the tables and any error lines printed.
finish_bench() {
  tar czf "$OUT/$1_logs.tgz" /tmp/speed_"$1"*.log /tmp/bw/*.log /tmp/bw/*.yaml 2>/dev/null
  grep -h "^|\|^loss curve\|^checkpoint\|rror" /tmp/speed_"$1"*.log | cut -c1-300
}
for step in "$@"; do
  echo "=== $step"
  # The GPUs' clocks, power and temperature each second of the step: a throughput that
  # differs between machines, or a kernel slower under the profiler, may be a clock (s14e).
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 1000 > "$OUT/smi_$step.csv" 2>/dev/null & smi_pid=$!
  trap 'kill $smi_pid 2>/dev/null' EXIT  # also when a step exits the script
  case $step in
    tests)  python3 -m pytest -q -p no:cacheprovider tests/unit/test_fused_loss_gpu.py tests/unit/test_fused_loss.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt" ;;
    gputests) { files="tests/unit/training/setup/test_fp8.py tests/recipes/test_fp8_full_recipe.py tests/recipes/test_activation_offloading.py tests/unit/training/setup/test_offloading.py"
              [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && files="$files tests/recipes/test_fsdp_cpu_offload.py"
              timeout 300 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA $files 2>&1 | grep -v "Warning\|warn" | tail -25; } \
              | tee "$OUT/gpu_tests.txt" ;;
    fp8smoke) { # tiny model (dims multiples of 16), 2 processes: FP8 + compile, and FSDP CPU offload
              for extra in "enable_fp8_training=True compile=True" "fsdp_cpu_offload=True"; do
                tag=$(echo $extra | cut -c1-12 | tr -c 'a-z0-9\n' _)
                timeout 240 python3 -m tune_recipes run --nproc_per_node 2 full_finetune_distributed --config tiny/full_distributed \
                  device=cuda dtype=bf16 max_steps_per_epoch=3 output_dir=/tmp/fs_$tag log_peak_memory_stats=True $extra > /tmp/fs_$tag.log 2>&1
                echo "$extra rc=$? $(tail -1 /tmp/fs_$tag/metrics.jsonl 2>/dev/null | cut -c1-220)"; grep -m3 "Error" /tmp/fs_$tag.log
              done; } 2>&1 | tee "$OUT/fp8smoke.txt" ;;
    speed)  # Both cases at once on 2+ GPUs (one per GPU: each case's variants share one GPU, in turn);
            # the 8B checkpoint is written first on GPU 1 while earlier steps use GPU 0 (untimed).
            if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
              wait  # a checkpoint started by ckpt8b
              CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_recipes.py --cases full_1b --reps 2 --work /tmp/bw \
                --run-timeout 240 --out "$OUT/recipes_full_1b.json" > /tmp/speed_full_1b.log 2>&1 &
              CUDA_VISIBLE_DEVICES=1 python3 scripts/bench_recipes.py --cases lora_8b --reps 2 --work /tmp/bw \
                --run-timeout 240 --out "$OUT/recipes_lora_8b.json" > /tmp/speed_lora_8b.log 2>&1 &
              wait
            else
              wait
              python3 scripts/bench_recipes.py --cases "${CASES:-full_1b,lora_8b}" --reps 2 --run-timeout 240 \
                --work /tmp/bw --out "$OUT/recipes_speed.json" > /tmp/speed.log 2>&1
            fi
            tar czf "$OUT/speed_logs.tgz" /tmp/speed*.log /tmp/bw/*.log /tmp/bw/*.yaml /tmp/ckpt8b.log 2>/dev/null
            grep -h "^|\|^loss curve\|^checkpoint\|Error" /tmp/speed*.log | cut -c1-230 ;;
    heads)  # Issue #15 in two calls of < 10 min: the head-to-head rows and the FP8 loss curve now
            # (1B on GPU 0; the 8B checkpoint, then its heads, on GPU 1), the levers in 'levers'.
            bench_on 0 full_1b stock_best,ours_best,ours_fused,ours_fused_fp8 2 heads_full_1b
            bench_on 1 lora_8b stock_best,ours_best 2 heads_lora_8b
            wait; finish_bench heads ;;
    levers) bench_on 0 full_1b ours_fused_inbwd,ours_best_ac 1 levers_full_1b
            bench_on 1 lora_8b ours_fused_ac,ours_fused_ac_offload 1 levers_lora_8b
            wait; finish_bench levers ;;
    fusedv3) # Issue #11: the default (fp32 logits, 9 chunks) beside the 1.2 GiB setting, the pre-issue-11
            # loss and peers. (The block-shifted rows of docs/benchmarks.md ran at commit e3aba93.)
            python3 scripts/bench_fused_ce.py --shapes 8192x4096 --baseline .whl/baseline_4f17736 \
              --methods baseline,ours,ours_16,ours_fp32,compiled,liger,cce \
              --out "$OUT/fused_8192.json" > /tmp/fused_8192.log 2>&1
            python3 scripts/bench_fused_ce.py --shapes 32768x4096,16384x2048 --iters 6 --warmup 2 --baseline .whl/baseline_4f17736 \
              --methods baseline,ours,ours_16,compiled,liger,cce --out "$OUT/fused_large.json" > /tmp/fused_large.log 2>&1
            grep -h "^|" /tmp/fused_8192.log /tmp/fused_large.log | cut -c1-160 ;;
    fusedv4) # Issue #11 after the target split: ours beside 916b32a's (fp32 logits, no split), the
            # pre-issue-11 loss and the peers, 8192x4096 both kinds (fusedv4large: the other shapes).
            mkdir -p .whl/previous_916b32a
            python3 scripts/bench_fused_ce.py --shapes 8192x4096 --baseline .whl/baseline_4f17736 \
              --previous .whl/previous_916b32a --methods baseline,previous,ours,ours_16,ours_fp32,compiled,liger,cce \
              --out "$OUT/fused_v4_8192.json" > /tmp/fused_v4_8192.log 2>&1
            grep -h "^|" /tmp/fused_v4_8192.log | cut -c1-170 ;;
    fusedv5) # Issue #11 after the review: the piece-split target sums, timed with frequent-token labels too.
            python3 scripts/bench_fused_ce.py --shapes 8192x4096 --kinds random,peaked,peaked_zipf \
              --time-kinds peaked,peaked_zipf --baseline .whl/baseline_4f17736 --previous .whl/previous_916b32a \
              --methods baseline,previous,ours,compiled,liger --out "$OUT/fused_v5_8192.json" > /tmp/fused_v5_8192.log 2>&1
            grep -h "^|" /tmp/fused_v5_8192.log | cut -c1-170 ;;
    fusedv6) # Issue #11, session 8: bf16 logits with each row's target logit recomputed in fp32 (ours)
            # beside 4247504's fp32 logits (v4), the pre-issue-11 loss and the peers; 8192x4096, three
            # input kinds, after the fused loss's tests (fusedv6large: the other shapes).
            python3 -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_fused_loss_gpu.py 2>&1 | grep "passed\|failed\|Error\|assert\|llama3 vocab\|peaked" | tail -12 | tee "$OUT/fused_gpu_tests.txt"
            timeout 420 python3 scripts/bench_fused_ce.py --shapes 8192x4096 --kinds random,peaked,peaked_zipf \
              --time-kinds peaked,peaked_zipf --baseline .whl/baseline_4f17736 --previous .whl/v4_4247504 \
              --previous-label "tune-recipes fused v4 (4247504): fp32 logits, target split" \
              --methods baseline,previous,ours,compiled,liger,cce --out "$OUT/fused_v6_8192.json" > /tmp/fused_v6_8192.log 2>&1
            grep -h "^|\|rror" /tmp/fused_v6_8192.log | cut -c1-200 ;;
    fusedv6large)
            python3 -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_fused_loss_gpu.py -k "exact_target or split_target" 2>&1 \
              | grep "passed\|failed\|Mismatch\|Greatest\|Error" | tail -12 | tee "$OUT/fused_gpu_tests_exact.txt"
            timeout 480 python3 scripts/bench_fused_ce.py --shapes 32768x4096,16384x2048 --iters 6 --warmup 2 \
              --baseline .whl/baseline_4f17736 --previous .whl/v4_4247504 \
              --previous-label "tune-recipes fused v4 (4247504): fp32 logits, target split" \
              --methods baseline,previous,ours,compiled,liger,cce --out "$OUT/fused_v6_large.json" > /tmp/fused_v6_large.log 2>&1
            grep -h "^|\|rror" /tmp/fused_v6_large.log | cut -c1-200 ;;
    fusedv4large)
            python3 scripts/bench_fused_ce.py --shapes 32768x4096,16384x2048 --iters 6 --warmup 2 \
              --baseline .whl/baseline_4f17736 --previous .whl/previous_916b32a \
              --methods baseline,previous,ours,compiled,liger,cce --out "$OUT/fused_v4_large.json" > /tmp/fused_v4_large.log 2>&1
            grep -h "^|" /tmp/fused_v4_large.log | cut -c1-170 ;;
    fp8dist) mkdir -p /tmp/dbg  # Bisect the 2-GPU FP8 + compile hang: FP8 eager, compile alone, both (stacks dumped at 70 s).
            export PYTHONFAULTHANDLER=1
            for extra in "enable_fp8_training=True" "compile=True" "enable_fp8_training=True compile=True"; do
              tag=$(echo $extra | tr -c 'a-z0-9\n' _ | cut -c1-40)
              TORCH_LOGS=recompiles timeout 150 python3 -m tune_recipes run --nproc_per_node 2 full_finetune_distributed \
                --config tiny/full_distributed device=cuda dtype=bf16 max_steps_per_epoch=3 output_dir=/tmp/fd_$tag \
                log_peak_memory_stats=True $extra > "/tmp/dbg/fp8dist_$tag.log" 2>&1 &
              pid=$!; for i in $(seq 70); do kill -0 $pid 2>/dev/null || break; sleep 1; done
              kill -0 $pid 2>/dev/null && pkill -ABRT -f "recipes/full_finetune_distributed.py"; wait $pid
              echo "$extra rc=$? steps=$(grep -c loss /tmp/fd_$tag/metrics.jsonl 2>/dev/null)"
            done; tar czf "$OUT/dbg.tgz" /tmp/dbg ;;
    where)  # Each side's best 1B step under the profiler (GPU 0) beside the lr-3e-4 FP8 curve (GPU 1).
            CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only stock_best_profiled,ours_best_profiled --run-timeout 200 \
              --out "$OUT/profiled_full_1b.json" > /tmp/where_prof.log 2>&1 &
            CUDA_VISIBLE_DEVICES=1 timeout 240 python3 scripts/bench_recipes.py --cases full_1b_curve --reps 1 --work /tmp/bw \
              --run-timeout 200 --out "$OUT/curve_full_1b.json" > /tmp/where_curve.log 2>&1 &
            wait
            python3 scripts/trace_summary.py /tmp/bw/prof_stock_best /tmp/bw/prof_ours_best > /tmp/where_traces.txt 2>&1
            tar czf "$OUT/where.tgz" /tmp/where*.log /tmp/where_traces.txt /tmp/bw/full_1b_curve*.log /tmp/bw/full_1b_*profiled*.log 2>/dev/null
            grep -h "^|\|^loss curve\|rror" /tmp/where_prof.log /tmp/where_curve.log | cut -c1-250; cut -c1-150 /tmp/where_traces.txt ;;
    qlora8b) # Issue #15's QLoRA half (never measured): 8B QLoRA stock / ours fused CE / + embedding in
            # CPU memory, 2 alternating reps (~7 min with the checkpoint build).
            ensure_ckpt8b
            bench_on 0 qlora_8b stock_best,ours_best,ours_fused_embcpu 2 qlora8b_qlora_8b
            wait; finish_bench qlora8b ;;
    data1b) # Issue #15's data path (never measured): 1B full FT on spread-length sequences, packed vs
            # padded, stock vs ours, one rep each (~6 min with the checkpoint build).
            bench_on 0 data_1b stock_best,ours_best,stock_padded,ours_padded 1 data1b_data_1b
            wait; finish_bench data1b ;;
    ain8b)  # Issue #15 (session 9): fp8_adapter_inputs. The 8B-shaped LoRA layers alone (bf16 / FP8 /
            # FP8 + adapter inputs; 21eff57 also timed the rank-8 product inside the adding kernel), then 8B LoRA
            # stock / ours FP8 + embcpu / + FP8 adapter inputs, and QLoRA stock / ours FP8 instead of NF4.
            ensure_ckpt8b &
            timeout 200 python3 scripts/bench_lora_layer.py --layers 2 --reps 1 --out "$OUT/lora_layer.json" 2>&1 \
              | grep -v "Warning\|Skipping\|quant_api" | tail -8
            wait
            bench_on 0 lora_8b stock_best,ours_fused_fp8_embcpu,ours_fp8_ain_embcpu 1 ain8b_lora_8b; wait
            bench_on 0 qlora_8b stock_best,ours_fp8_instead 1 ain8b_qlora_8b; wait
            finish_bench ain8b ;;
    final8b) # Issue #15 (session 9): FP8 LoRA's GPU tests (with fp8_adapter_inputs), then 8B LoRA stock vs
            # ours best (FP8 base + FP8 adapter inputs + embedding in CPU memory), 2 alternating reps,
            # then the 220-step lr-1e-3 curves bf16 / FP8 + FP8 adapter inputs (~8 min in all).
            ensure_ckpt8b &
            timeout 110 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_fp8_lora.py \
              2>&1 | grep "passed\|failed\|Error\|assert" | tail -8 | tee "$OUT/final8b_tests.txt"
            wait
            bench_on 0 lora_8b stock_best,ours_fp8_ain_embcpu 2 final8b_lora_8b; wait
            bench_on 0 lora_8b_curve ours_fused,ours_fp8_ain 1 final8b_curve; wait
            finish_bench final8b ;;
    where1b) # Issue #15: ours' best 1B step (whole model compiled) under the profiler, summed by kernel
            # kind; stock's 1B profile (2026-11-30) is unchanged since. NOTE: give it ~7 min: session 9's
            # try with 165 s was killed inside the whole-model compile (checkpoint 33 s, then > 130 s).
            timeout 420 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_profiled --run-timeout 400 --out "$OUT/profiled_full_1b.json" > /tmp/where1b_prof.log 2>&1
            python3 scripts/trace_summary.py --top 80 /tmp/bw/prof_ours_best_model > /tmp/where1b_traces.txt 2>&1
            tar czf "$OUT/where1b.tgz" /tmp/where1b*.log /tmp/where1b_traces.txt /tmp/bw/full_1b_*profiled*.log 2>/dev/null
            grep -h "rror" /tmp/where1b_prof.log | cut -c1-250; cut -c1-150 /tmp/where1b_traces.txt ;;
    tw8b)   # Issue #15 next (~9 min): the FP8 weights also stored transposed (fp8_transposed_weight_layers).
            # The 8B-shaped layers alone (FP8 + adapter inputs, with and without), then 8B LoRA stock /
            # ours best / ours best + 20 layers transposed, 2 alternating reps.
            ensure_ckpt8b &
            timeout 150 python3 scripts/bench_lora_layer.py --layers 2 --reps 2 --variants fp8_inputs,fp8_inputs_t \
              --out "$OUT/lora_layer_t.json" 2>&1 | grep -v "Warning\|Skipping\|quant_api" | tail -5
            wait
            bench_on 0 lora_8b stock_best,ours_fp8_ain_embcpu,ours_fp8_ain_embcpu_t20 2 tw8b_lora_8b; wait
            finish_bench tw8b ;;
    s10a)   # Issue #15, session 10 (~9 min): FP8 LoRA's GPU tests (post-review function, transposed
            # weights), then 8B LoRA stock / ours best / ours best + 20 layers' FP8 weights stored
            # transposed, 2 alternating reps.
            ensure_ckpt8b &
            timeout 110 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_fp8_lora.py \
              2>&1 | grep "passed\|failed\|Error\|assert" | tail -12 | tee "$OUT/s10a_tests.txt"
            wait
            bench_on 0 lora_8b stock_best,ours_fp8_ain_embcpu,ours_fp8_ain_embcpu_t20 2 s10a_lora_8b; wait
            finish_bench s10a ;;
    s10b)   # Issue #15, session 10 (~8 min): the data path (1B full FT, spread lengths, packed vs padded,
            # one rep each) while the 8B checkpoint builds, then the 220-step lr-1e-3 curve of
            # FP8 + adapter inputs + 20 transposed layers (bf16's is session 9's: same checkpoint seed and data).
            ensure_ckpt8b &
            timeout 330 python3 scripts/bench_recipes.py --cases data_1b --only stock_best,ours_best,stock_padded,ours_padded \
              --reps 1 --work /tmp/bw --run-timeout 120 --out "$OUT/s10b_data_1b.json" > /tmp/speed_s10b_data_1b.log 2>&1
            wait
            timeout 200 python3 scripts/bench_recipes.py --cases lora_8b_curve --only ours_fp8_ain_t20 --reps 1 \
              --work /tmp/bw --run-timeout 190 --out "$OUT/s10b_curve.json" > /tmp/speed_s10b_curve.log 2>&1
            finish_bench s10b ;;
    s10c)   # Issue #15, session 10 (~7 min): 1B with the whole model compiled, the in-backward optimizer
            # (session 9's 1.20x) against one fused optimizer step after backward; stock beside, 1 rep.
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --only stock_best,ours_best_model,ours_best_model_step \
              --reps 1 --work /tmp/bw --run-timeout 300 --out "$OUT/s10c_full_1b.json" > /tmp/speed_s10c.log 2>&1
            finish_bench s10c ;;
    s10d)   # Issue #15, session 10 (~6 min): the data path alone (1B full FT, spread lengths, packed vs
            # padded, stock vs ours, one rep each).
            timeout 560 python3 scripts/bench_recipes.py --cases data_1b --only stock_best,ours_best,stock_padded,ours_padded \
              --reps 1 --work /tmp/bw --run-timeout 200 --out "$OUT/s10d_data_1b.json" > /tmp/speed_s10d.log 2>&1
            finish_bench s10d ;;
    s10e)   # Issue #15, session 10 (~7 min; quicker on the machine that ran s10c, whose compile cache and
            # checkpoints it reuses): ours' best 1B step (s10c's one-optimizer-step variant) under the
            # profiler, summed by kernel kind; then the 220-step lr-1e-3 curve of FP8 + adapter inputs +
            # 20 transposed layers (bf16's is session 9's: same checkpoint seed and data).
            timeout 240 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_step_profiled --run-timeout 230 --out "$OUT/s10e_profiled_full_1b.json" > /tmp/speed_s10e_prof.log 2>&1
            python3 scripts/trace_summary.py --top 80 /tmp/bw/prof_ours_best_model_step > "$OUT/s10e_traces.txt" 2>&1
            ensure_ckpt8b
            timeout 300 python3 scripts/bench_recipes.py --cases lora_8b_curve --only ours_fp8_ain_t20 --reps 1 \
              --work /tmp/bw --run-timeout 290 --out "$OUT/s10e_curve.json" > /tmp/speed_s10e_curve.log 2>&1
            finish_bench s10e; cut -c1-150 "$OUT/s10e_traces.txt" | head -60 ;;
    s10f)   # Issue #15, session 10 (~4 min): why ours ran 0.94x stock on packed spread-length data (s10d):
            # stock / ours best (FP8) / ours without FP8 / ours FP8 with the whole model compiled, 1 rep,
            # with every run's metrics.jsonl.
            timeout 500 python3 scripts/bench_recipes.py --cases data_1b --only stock_best,ours_best,ours_packed_nofp8,ours_packed_model \
              --reps 1 --work /tmp/bw --run-timeout 200 --out "$OUT/s10f_data_1b.json" > /tmp/speed_s10f.log 2>&1
            tar czf "$OUT/s10f_metrics.tgz" /tmp/bw/data_1b_*/metrics.jsonl 2>/dev/null
            finish_bench s10f ;;
    s10g)   # Issue #15, session 10 (~6 min): the optimizer step alone at the 1B shapes (8.5 ms of the 1B step:
            # fused / foreach / compiled / torchao 8-bit) while the 8B checkpoint builds, then the 220-step
            # lr-1e-3 curves of FP8 + adapter inputs with and without 20 transposed layers in one run (s10e's
            # transposed run had a loss excursion at steps 59-73 that no earlier curve showed).
            ensure_ckpt8b &
            timeout 150 python3 scripts/bench_optimizer_step.py --out "$OUT/s10g_optimizer_step.json" 2>&1 \
              | grep -v "Warning\|Skipping\|quant_api\|warn" | tail -7
            wait
            timeout 330 python3 scripts/bench_recipes.py --cases lora_8b_curve --only ours_fp8_ain,ours_fp8_ain_t20 --reps 1 \
              --work /tmp/bw --run-timeout 160 --out "$OUT/s10g_curve.json" > /tmp/speed_s10g_curve.log 2>&1
            finish_bench s10g ;;
    s10h)   # Issue #15, session 10 (~1 min): would an FP8 LM head pay? Its three products in bf16 vs FP8
            # (casts counted) at the 1B and 8B head shapes, and what FP8 does to logits, loss and gradients.
            timeout 150 python3 scripts/bench_fp8_head.py --out "$OUT/s10h_fp8_head.json" 2>&1 \
              | grep -v "Warning\|Skipping\|quant_api" | tail -5 ;;
    next1b) # Issue #15 next (~8 min): 1B stock / ours best / ours best + compile_optimizer_step (built in
            # session 10 after the device time ran out), 2 alternating reps; then the recipe's GPU test of
            # the compiled step is the head-to-head itself (same losses expected to bf16 rounding).
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --only stock_best,ours_best_model_step,ours_best_model_cstep \
              --reps 2 --work /tmp/bw --run-timeout 300 --out "$OUT/next1b_full_1b.json" > /tmp/speed_next1b.log 2>&1
            finish_bench next1b ;;
    s11a)   # Session 11 (~8 min): stock vs ours + compiled optimizer step, 2 alternating reps; then
            # once each: coordinate-descent tuning, half-size loss chunks (the 0.04 GiB over). On a
            # fresh machine only the first rep fit: the tuning run took its 240 s without a step.
            timeout 570 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_cstep,ours_best_model_cstep_cdt,ours_best_model_cstep_c328 \
              --reps 2 --work /tmp/bw --run-timeout 240 --out "$OUT/s11a_full_1b.json" > /tmp/speed_s11a.log 2>&1
            finish_bench s11a ;;
    s11b)   # Session 11 (~9 min): stock vs ours + compiled optimizer step again (2 reps), and once each
            # the two bench_hooks levers: activation memory budget 0.9, FP8 off the small k/v layers.
            timeout 575 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_cstep,ours_best_model_cstep_amb90,ours_best_model_cstep_autofilter \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s11b_full_1b.json" > /tmp/speed_s11b.log 2>&1
            finish_bench s11b ;;
    s11c)   # Session 11 (~4 min): where ours' 1B peak memory is (every allocation recorded, replayed).
            rm -f /tmp/bw/memsnap_1b.*
            timeout 400 python3 scripts/bench_recipes.py --cases full_1b --only ours_best_model_cstep_memsnap \
              --reps 1 --work /tmp/bw --run-timeout 380 --out "$OUT/s11c_full_1b.json" > /tmp/speed_s11c.log 2>&1
            for f in $(ls -S /tmp/bw/memsnap_1b.* | grep -v peaks.json | head -1); do
              python3 scripts/memory_peak.py "$f" --top 40 | tee "$OUT/s11c_memory_peak.txt"; done
            finish_bench s11c ;;
    s11d)   # Session 11 (~7 min): 8B QLoRA stock vs ours' FP8 base instead of NF4, 2 alternating reps
            # (session 9 ran one).
            ensure_ckpt8b
            timeout 470 python3 scripts/bench_recipes.py --cases qlora_8b --only stock_best,ours_fp8_instead \
              --reps 2 --work /tmp/bw --run-timeout 150 --out "$OUT/s11d_qlora_8b.json" > /tmp/speed_s11d.log 2>&1
            finish_bench s11d ;;
    s12a)   # Next (~5 min): per-layer FP8 vs no FP8 on packed data under the profiler (the unexplained
            # 163 vs 129 ms step of session 10), summed by kernel kind.
            timeout 480 python3 scripts/bench_recipes.py --cases data_1b --reps 1 --work /tmp/bw \
              --only ours_best_profiled,ours_packed_nofp8_profiled --run-timeout 230 \
              --out "$OUT/s12a_data_1b.json" > /tmp/s12a_prof.log 2>&1
            python3 scripts/trace_summary.py --top 60 /tmp/bw/prof_data_ours_best /tmp/bw/prof_data_ours_packed_nofp8 \
              > /tmp/s12a_traces.txt 2>&1
            tar czf "$OUT/s12a.tgz" /tmp/s12a*.log /tmp/s12a_traces.txt /tmp/bw/data_1b_*profiled*.log 2>/dev/null
            grep -h "rror" /tmp/s12a_prof.log | cut -c1-250; cut -c1-150 /tmp/s12a_traces.txt ;;
    s12b)   # Next (~10 min): the compiled optimizer step against the plain one in the same run (sessions
            # 10 and 11 compared across machines), 2 alternating reps with stock; then once each the
            # activation memory budgets 0.98 and 0.95 (0.9 cost 2.4% for 0.61 GiB; 0.04 GiB is needed).
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_step,ours_best_model_cstep,ours_best_model_cstep_amb98,ours_best_model_cstep_amb95 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s12b_full_1b.json" > /tmp/speed_s12b.log 2>&1
            finish_bench s12b ;;
    s12c)   # Session 12 (~9 min): FP8 fast accumulation in the backward products: the products alone
            # at the 1B and 8B shapes (time and error), then in the recipe (one run) beside stock and
            # ours' best (2 alternating reps), and loss chunks of twice the default (one run).
            timeout 100 python3 scripts/bench_fp8_accum.py --out "$OUT/s12c_fp8_accum.json" 2>&1 \
              | tee /tmp/s12c_accum.log | tail -9
            timeout 480 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_cstep,ours_best_model_cstep_fastacc,ours_best_model_cstep_c1312 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s12c_full_1b.json" > /tmp/speed_s12c.log 2>&1
            finish_bench s12c ;;
    s12d)   # Session 12 (~8 min): the 220-step 1B loss curve (lr 3e-4, per-layer compile): bf16, FP8 as
            # shipped, FP8 with fast accumulation in backward too.
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b_curve \
              --only ours_fused,ours_fused_fp8,ours_fused_fp8_fastacc --reps 1 --work /tmp/bw \
              --run-timeout 250 --out "$OUT/s12d_full_1b_curve.json" > /tmp/speed_s12d.log 2>&1
            finish_bench s12d ;;
    s12e)   # Session 12 (~7 min): fast accumulation + 1312-row loss chunks together, 2 alternating reps
            # with stock, and once with activation memory budget 0.95.
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast,ours_best_model_fast_amb95 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s12e_full_1b.json" > /tmp/speed_s12e.log 2>&1
            finish_bench s12e ;;
    s12f)   # Session 12 (~7 min, the last device time): s12e's 0.95 took 0.61 GiB (3.7%) where 0.04 is
            # needed: budgets 0.99 and 0.98 once each beside stock.
            timeout 450 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast_amb99,ours_best_model_fast_amb98 \
              --reps 1 --work /tmp/bw --run-timeout 200 --out "$OUT/s12f_full_1b.json" > /tmp/speed_s12f.log 2>&1
            finish_bench s12f ;;
    s13smoke) # First GPU run of fp8_mlp_activations in the full fine-tune (run after gputests, whose
            # recipe test runs it on the tiny model): ours' best + it at 1B alone, once (speed and
            # peak; per-token scales then, the variant's meaning has changed since).
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b --only ours_best_model_fast_mlp8 \
              --reps 1 --work /tmp/bw --run-timeout 200 --out "$OUT/s13smoke_full_1b.json" > /tmp/speed_s13smoke.log 2>&1
            finish_bench s13smoke ;;
    s13prof) # s12e's best with and without fp8_mlp_activations under the profiler (steps 7-9), by kernel.
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_fast_profiled,ours_best_model_fast_mlp8_profiled --run-timeout 260 \
              --out "$OUT/s13prof_full_1b.json" > /tmp/s13prof.log 2>&1
            python3 scripts/trace_summary.py --top 100 /tmp/bw/prof_ours_best_model_fast /tmp/bw/prof_ours_best_model_fast_mlp8 > /tmp/s13prof_traces.txt 2>&1
            cp /tmp/s13prof_traces.txt "$OUT/"
            tar czf "$OUT/s13prof.tgz" /tmp/s13prof*.log /tmp/bw/full_1b_*profiled*.log 2>/dev/null
            grep -h "rror" /tmp/s13prof.log | cut -c1-250; grep -A14 "^==\|GPU busy" /tmp/s13prof_traces.txt | cut -c1-150 | head -60 ;;
    s13c)   # fp8_mlp_activations with one scale per tensor (then bench hooks, now the defaults): every MLP, the first only;
            # then the MLP alone (torchao / per tensor / per token), with inductor's code.
            timeout 390 python3 scripts/bench_recipes.py --cases full_1b \
              --only ours_best_model_fast_mlp8,ours_best_model_fast_mlp8_l1 \
              --reps 1 --work /tmp/bw --run-timeout 190 --out "$OUT/s13c_full_1b.json" > /tmp/speed_s13c.log 2>&1
            finish_bench s13c
            timeout 170 python3 scripts/bench_fp8_mlp.py --variants tensor,torchao,rows --out "$OUT/s13c_fp8_mlp.json" \
              --code-dir /tmp/mlpcode 2>&1 | tail -8
            tar czf "$OUT/s13c_mlpcode.tgz" /tmp/mlpcode 2>/dev/null ;;
    s14a)   # Next (~8 min): stock / s12e's best + fp8_mlp_layers 1 (15.00 GiB in s13c, one run), 2
            # alternating reps: the side-by-side claim for 1.3x at <= 0.75x (s12e's best without the
            # key, 78,262 tok/s, and s13e's 76,530 are the references for its cost).
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast_mlp8_l1 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s14a_full_1b.json" > /tmp/speed_s14a.log 2>&1
            finish_bench s14a ;;
    s14b)   # Next (~7 min): fp8_mlp_activations' 220-step loss curve (per-tensor scales) beside FP8 +
            # fast accumulation and bf16 (lr 3e-4).
            timeout 590 python3 scripts/bench_recipes.py --cases full_1b_curve \
              --only ours_fused,ours_fused_fp8_fastacc,ours_fused_fp8_fastacc_mlp8 --reps 1 --work /tmp/bw \
              --run-timeout 250 --out "$OUT/s14b_full_1b_curve.json" > /tmp/speed_s14b.log 2>&1
            finish_bench s14b ;;
    s14d)   # Later (~10 min with the 8B checkpoint): LoRA's fp8_mlp_activations per token (its default)
            # against per tensor (bench hook), next to the FP8 base alone, one run each.
            ensure_ckpt8b
            timeout 560 python3 scripts/bench_recipes.py --cases lora_8b --reps 1 --work /tmp/bw \
              --only ours_fused_fp8_embcpu,ours_fused_fp8_mlp8_embcpu,ours_fused_fp8_mlp8t_embcpu \
              --run-timeout 200 --out "$OUT/s14d_lora_8b.json" > /tmp/speed_s14d.log 2>&1
            finish_bench s14d ;;
    fa4a)   # FlashAttention-4, call 1 of 2 (scripts/fa4_wheels.sh; carry .fa4_part1 only): the first
            # part of the CUTLASS DSL library stays on this warm machine for step fa4, which must be
            # the very next call (within 30 s), carrying .whl, .whl_fa4 and .fa4_part2.
            ls -la .fa4_part1 ;;
    fa4)    # FlashAttention-4, call 2 of 2 (~7 min): join and unpack the library, install FA4, then SDPA
            # alone (cuDNN / torch's flash / FA4, 1B and 8B shapes, checked against fp32) and the 1B
            # best with FA4 (bench hook), beside the best as it is, one run each.
            cat .fa4_part1/cu13.tar.xz.00 .fa4_part2/cu13.tar.xz.0[1-9] > /tmp/cu13.tar.xz
            (cd /tmp && sha256sum -c "$OLDPWD/.fa4_part2/cu13.tar.xz.sha256") || exit 1
            xz -dc /tmp/cu13.tar.xz | tar -x -C /tmp/site
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
              --target /tmp/site .whl_fa4/*.whl >/dev/null 2>&1
            # What the nvidia-cutlass-dsl meta-package's .pth file does (--target folders run none).
            export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
            python3 -c "import flash_attn.cute.interface as m; print('FA4 imports:', m.__file__)" 2>&1 | tail -3
            timeout 150 python3 scripts/bench_attention.py --out "$OUT/fa4_attention.json" 2>&1 | tail -12
            timeout 400 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_fast,ours_best_model_fast_fa4 --run-timeout 190 \
              --out "$OUT/fa4_full_1b.json" > /tmp/speed_fa4.log 2>&1
            finish_bench fa4 ;;
    s14c)   # Next (~6 min): where s12e's best step waits (profile: GPU idle gaps charged to host ops),
            # and the same under CUDA graphs (compile mode reduce-overhead, bench hook), one run each.
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_fast_profiled,ours_best_model_fast_cg --run-timeout 260 \
              --out "$OUT/s14c_full_1b.json" > /tmp/s14c.log 2>&1
            python3 scripts/trace_summary.py --top 40 /tmp/bw/prof_ours_best_model_fast > "$OUT/s14c_traces.txt" 2>&1
            # The trace itself (gzipped by the profiler), for reading offline, if under the 16 MiB a
            # file that comes back may have.
            trace=$(find /tmp/bw/prof_ours_best_model_fast -name '*.json.gz' -size -16M | head -1)
            [ -n "$trace" ] && cp "$trace" "$OUT/s14c_trace.json.gz"
            finish_bench s14c; grep -A42 "GPU idle" "$OUT/s14c_traces.txt" | cut -c1-150 ;;
    s14e)   # Session 14 (~8 min): s14c found a host sync per step, the fused loss's grad_output.item()
            # at the start of backward; the driver now declares it (declare_grad_output). The claim
            # again (stock / best + fp8_mlp_layers 1, 2 alternating reps), then the profile of best.
            timeout 420 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast_mlp8_l1 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s14e_full_1b.json" > /tmp/speed_s14e.log 2>&1
            rm -rf /tmp/bw/prof_ours_best_model_fast
            timeout 150 python3 scripts/bench_recipes.py --cases full_1b --reps 1 --work /tmp/bw \
              --only ours_best_model_fast_profiled --run-timeout 140 \
              --out "$OUT/s14e_profiled.json" > /tmp/speed_s14e_prof.log 2>&1
            python3 scripts/trace_summary.py --top 12 /tmp/bw/prof_ours_best_model_fast > "$OUT/s14e_traces.txt" 2>&1
            trace=$(find /tmp/bw/prof_ours_best_model_fast -name '*.json.gz' -size -16M | head -1)
            [ -n "$trace" ] && cp "$trace" "$OUT/s14e_trace.json.gz"
            finish_bench s14e; head -3 "$OUT/s14e_traces.txt" | cut -c1-200; grep -A8 "GPU idle" "$OUT/s14e_traces.txt" | cut -c1-150 ;;
    s15a)   # Next (~9 min): declare_grad_output's A/B on one machine (the fused loss's old host sync
            # through BENCH_FLCE_READ_GRAD_OUTPUT) beside stock, 2 alternating reps: a third
            # side-by-side run of the 1B claim (s14a 1.294x before the change, s14e 1.301x after).
            timeout 580 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast_mlp8_l1,ours_best_model_fast_mlp8_l1_sync \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s15a_full_1b.json" > /tmp/speed_s15a.log 2>&1
            finish_bench s15a ;;
    s15c)   # Session 15 (~9 min): the 1B claim, 3 alternating reps (s15a lost its first rep of ours to the
            # 200 s run timeout: a cold compile cache took ~170 s of it on a fresh machine).
            timeout 580 python3 scripts/bench_recipes.py --cases full_1b \
              --only stock_best,ours_best_model_fast_mlp8_l1 \
              --reps 3 --work /tmp/bw --run-timeout 300 --out "$OUT/s15c_full_1b.json" > /tmp/speed_s15c.log 2>&1
            finish_bench s15c ;;
    s15d)   # Session 15 (~7 min): the 8B LoRA claim since the fused loss's host sync went (s10a: 1.318x at
            # 0.729x before it), stock / best, 2 alternating reps.
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --cases lora_8b --only stock_best,ours_fp8_ain_embcpu_t20 \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s15d_lora_8b.json" > /tmp/speed_s15d.log 2>&1
            finish_bench s15d ;;
    s15e)   # Session 15 (~5 min, after s15d on the same machine: its 8B checkpoint): the 8B QLoRA claim
            # since the host sync went (s11d: 1.360x at 0.561x), stock / FP8 base instead of NF4, 2 reps.
            ensure_ckpt8b
            timeout 330 python3 scripts/bench_recipes.py --cases qlora_8b --only stock_best,ours_fp8_instead \
              --reps 2 --work /tmp/bw --run-timeout 150 --out "$OUT/s15e_qlora_8b.json" > /tmp/speed_s15e.log 2>&1
            finish_bench s15e ;;
    s16a)   # Next (~7 min): issue #15's 1B claim as a 220-step curve against stock's (lr 3e-4, the
            # claimed settings exactly; s14b's curves were per-layer compile, all layers' e4m3 MLP).
            # Ours' first run on a fresh machine compiles ~170 s (s15a, s15c).
            timeout 560 python3 scripts/bench_recipes.py --preset curves --cases full_1b_curve --reps 1 \
              --work /tmp/bw --run-timeout 420 --out "$OUT/s16a_curve_full_1b.json" > /tmp/speed_s16a.log 2>&1
            finish_bench s16a ;;
    s16f)   # (run 2026-12-02, session 18, 432 s, after s18b): FP8 rowwise at recipe level beside its tensorwise twin (session 11's best:
            # whole model compiled + compiled optimizer step) and stock, 1 run each.
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --reps 1 \
              --only stock_best,ours_best_model_cstep,ours_best_model_cstep_rowwise \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s16f_rowwise_full_1b.json" > /tmp/speed_s16f.log 2>&1
            finish_bench s16f ;;
    s16b)   # Next (~7 min): the 8B LoRA claim's 220-step curve against stock's (lr 1e-3, the claimed
            # settings with the embedding in CPU memory; session 10's curves were without it).
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --preset curves --cases lora_8b_curve --reps 1 \
              --work /tmp/bw --run-timeout 220 --out "$OUT/s16b_curve_lora_8b.json" > /tmp/speed_s16b.log 2>&1
            finish_bench s16b ;;
    s16c)   # Next (~6 min, after s16b on the same machine: its 8B checkpoint): the QLoRA claim's
            # 220-step curve, stock's NF4 QLoRA against ours' FP8 base in its place (lr 1e-3).
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --preset curves --cases qlora_8b_curve --reps 1 \
              --work /tmp/bw --run-timeout 220 --out "$OUT/s16c_curve_qlora_8b.json" > /tmp/speed_s16c.log 2>&1
            finish_bench s16c ;;
    s16d)   # Next (~7 min): what ours' memory buys at 1B (preset memory): the allocator capped at
            # 19.5 GiB as on a 20 GiB GPU: stock's best (reserved ~21.9 GiB uncapped), stock with
            # activation checkpointing, ours' claim (~16.6 reserved); stock uncapped as the reference.
            timeout 560 python3 scripts/bench_recipes.py --preset memory --cases full_1b \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s16d_memory_full_1b.json" > /tmp/speed_s16d.log 2>&1
            finish_bench s16d ;;
    s16e)   # Next (~8 min): the same at 8B LoRA, capped at 23.5 GiB as on a 24 GiB GPU (ours without
            # transposed weights: 21.43 GiB allocated, ~22.6 reserved).
            ensure_ckpt8b
            timeout 470 python3 scripts/bench_recipes.py --preset memory --cases lora_8b \
              --work /tmp/bw --run-timeout 220 --out "$OUT/s16e_memory_lora_8b.json" > /tmp/speed_s16e.log 2>&1
            finish_bench s16e ;;
    s19a)   # Run in session 19 (2026-12-02, 360 s: 1.308x at 0.746x): issue #15's claim table as the one command a user runs (`--preset claim`,
            # 2 reps, alternating), split by case only because one device call may run 600 s at
            # most: 1B here, 8B LoRA in s19b, QLoRA in s19c; merge the three JSONs. s15c-e ran the
            # same variants through --only.
            timeout 560 python3 scripts/bench_recipes.py --preset claim --cases full_1b --reps 2 \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s19a_claim_full_1b.json" > /tmp/speed_s19a.log 2>&1
            finish_bench s19a ;;
    s19b)   # Run in session 19 (280 s with the 8B checkpoint's build, which runs before the timeout below; 1.329x at 0.729x):
            # the same for 8B LoRA (s15d: 205 s of runs).
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --preset claim --cases lora_8b --reps 2 \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s19b_claim_lora_8b.json" > /tmp/speed_s19b.log 2>&1
            finish_bench s19b ;;
    s19c)   # Run in session 19 (252 s after s19b on the same machine; 1.357x at 0.561x): the same for QLoRA (s15e: 233 s).
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --preset claim --cases qlora_8b --reps 2 \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s19c_claim_qlora_8b.json" > /tmp/speed_s19c.log 2>&1
            finish_bench s19c ;;
    s19d)   # Next, on the nvidia-h200-x2 kind (~6-9 min; not lent in sessions 13-19): issue #15's
            # last lever, FP8 full fine-tunes distributed: stock's best (compile) against ours'
            # (compile + fused CE + FP8 + fast accumulation in backward) on 2 GPUs, 2 reps.
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b_2gpu_fp8 --reps 2 \
              --only stock_best,ours_fp8 \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s19d_fp8_full_1b_2gpu.json" > /tmp/speed_s19d.log 2>&1
            finish_bench s19d ;;
    s19e)   # After s19d on the same x2 machine (~4 min): ours' bf16 twin once (what FP8 adds),
            # beside stock's best once more (the ratio from this run's own stock row).
            timeout 400 python3 scripts/bench_recipes.py --cases full_1b_2gpu_fp8 --reps 1 \
              --only stock_best,ours_bf16 \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s19e_bf16_full_1b_2gpu.json" > /tmp/speed_s19e.log 2>&1
            finish_bench s19e ;;
    s18a)   # (run 2026-12-02, session 18, 491 s with the 8B checkpoint): the 8B LoRA claim's curve against stock's at
            # torchtune's own lr 3e-4, each side twice more (s17f ran each once: matched, ours lower;
            # merge with it for 3 runs a side).
            ensure_ckpt8b
            timeout 480 python3 scripts/bench_recipes.py --cases lora_8b_curve --reps 2 --every-rep \
              --only stock_best_lr3e4,ours_claim_lr3e4 \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s18a_curves_lora_8b_lr3e4.json" > /tmp/speed_s18a.log 2>&1
            finish_bench s18a ;;
    s18b)   # (run 2026-12-02, session 18, 454 s, after s18a): the same for QLoRA, stock's NF4 against
            # ours' FP8 base at lr 3e-4 (torchtune's 8B QLoRA learning rate), each side twice.
            ensure_ckpt8b
            timeout 480 python3 scripts/bench_recipes.py --cases qlora_8b_curve --reps 2 --every-rep \
              --only stock_best_lr3e4,ours_claim_lr3e4 \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s18b_curves_qlora_8b_lr3e4.json" > /tmp/speed_s18b.log 2>&1
            finish_bench s18b ;;
    s18c)   # (run 2026-12-02, session 18, 232 s, after s16f): at lr 1e-3, the 8B LoRA claim without FP8 adapter inputs, twice
            # (s17a: one of ours' 3 runs ended in a spike episode above all 4 of stock's; merge with
            # s16b, s16g and s17a for stock's runs).
            ensure_ckpt8b
            timeout 400 python3 scripts/bench_recipes.py --cases lora_8b_curve --reps 2 --every-rep \
              --only ours_claim_no_ain \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s18c_curves_lora_8b_no_ain.json" > /tmp/speed_s18c.log 2>&1
            finish_bench s18c ;;
    s18d)   # Next (~5 min with the 8B checkpoint already built, ~6.5 without): ours' step-0 loss
            # differs between machines (s16 12.6249, s17 12.6291, s18 12.6300; stock's LoRA moved
            # 5.7e-4 in s18, about a ninth of ours' 5.1e-3 spread). Runs compiled afresh, without and with inductor's
            # deterministic mode, twice each (6 steps): do the two modes' first losses differ, and
            # does the deterministic one match in a later session on another machine?
            ensure_ckpt8b
            timeout 400 python3 scripts/bench_recipes.py --cases lora_8b_curve --reps 2 --every-rep \
              --only ours_claim_fresh,ours_claim_fresh_det \
              --work /tmp/bw --run-timeout 180 --out "$OUT/s18d_fresh_compile_lora_8b.json" > /tmp/speed_s18d.log 2>&1
            finish_bench s18d
            python3 -c "import json,sys; [print(r['variant'], r['rep'], [round(x, 5) for x in r.get('losses', [])[:3]], r.get('error', '')[-200:]) for r in json.load(open(sys.argv[1]))['rows']]" "$OUT/s18d_fresh_compile_lora_8b.json" ;;
    s17a)   # (run 2026-12-02, session 17, 438 s): the 8B LoRA claim's curve against stock's, each
            # side twice (preset curves, 2 reps): s16b's gap read against each side's own run-to-run
            # spread (s16b/s16g: stock's two runs 0.06% apart on the last-20 mean, spikes at lr 1e-3).
            ensure_ckpt8b
            timeout 500 python3 scripts/bench_recipes.py --preset curves --cases lora_8b_curve \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s17a_curves_lora_8b.json" > /tmp/speed_s17a.log 2>&1
            finish_bench s17a ;;
    s17b)   # (run 2026-12-02, session 17, after s17a): the same for QLoRA, stock's NF4 against ours'
            # FP8 base (s16c: ours 0.87% above on the last-20 mean, 20 spikes against 17).
            ensure_ckpt8b
            timeout 500 python3 scripts/bench_recipes.py --preset curves --cases qlora_8b_curve \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s17b_curves_qlora_8b.json" > /tmp/speed_s17b.log 2>&1
            finish_bench s17b ;;
    s17c)   # (run 2026-12-02, session 17): stock's third option on a
            # 20 GiB GPU, half the micro-batch with GA 2, beside stock's uncapped best and ours capped on
            # the same machine (s16d ran stock's best, out of memory there, and stock checkpointed).
            timeout 500 python3 scripts/bench_recipes.py --preset memory --cases full_1b \
              --only stock_best,stock_ga2_20g,ours_claim_20g \
              --work /tmp/bw --run-timeout 250 --out "$OUT/s17c_memory_ga2_full_1b.json" > /tmp/speed_s17c.log 2>&1
            finish_bench s17c ;;
    s17e)   # (run 2026-12-02, session 17): the same at 8B LoRA on a 24 GiB GPU, stock at batch 1 x GA 2 (s16e).
            ensure_ckpt8b
            timeout 450 python3 scripts/bench_recipes.py --preset memory --cases lora_8b \
              --only stock_best,stock_ga2_24g,ours_fp8_ain_embcpu_24g \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s17e_memory_ga2_lora_8b.json" > /tmp/speed_s17e.log 2>&1
            finish_bench s17e ;;
    s17f)   # (run 2026-12-02, session 17, after s17a): the 8B LoRA claim's curve against stock's
            # at torchtune's own 8B LoRA learning rate, 3e-4 (fewer spikes than at 1e-3?), one run each.
            ensure_ckpt8b
            timeout 400 python3 scripts/bench_recipes.py --cases lora_8b_curve --reps 1 \
              --only stock_best_lr3e4,ours_claim_lr3e4 \
              --work /tmp/bw --run-timeout 200 --out "$OUT/s17f_curve_lora_8b_lr3e4.json" > /tmp/speed_s17f.log 2>&1
            finish_bench s17f ;;
    s17d)   # Next (~7 min): the packed-data case with the 1B claim's settings (session 10's best packed,
            # 1.094x, was whole-model compile + FP8 without the later levers), 2 alternating reps,
            # then the claim's packed profile (steps 8-10) for where its time goes.
            timeout 480 python3 scripts/bench_recipes.py --cases data_1b --reps 2 \
              --only stock_best,ours_claim_packed,ours_claim_packed_profiled \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s17d_data_1b.json" > /tmp/speed_s17d.log 2>&1
            finish_bench s17d
            tar czf "$OUT/s17d_profile.tgz" /tmp/bw/prof_data_ours_claim_packed 2>/dev/null
            python3 scripts/trace_summary.py --scope _FusedLinearCrossEntropy /tmp/bw/prof_data_ours_claim_packed \
              > "$OUT/s17d_profile.txt" 2>&1; tail -30 "$OUT/s17d_profile.txt" ;;
    s17g)   # Next (~8 min, right after s17d on the same machine: its compile cache): the packed claim
            # with flex attention traced into the whole-model graph (bench hook BENCH_FLEX_IN_GRAPH; no
            # graph break per layer) beside the packed claim and stock, 2 alternating reps.
            timeout 560 python3 scripts/bench_recipes.py --cases data_1b --reps 2 \
              --only stock_best,ours_claim_packed,ours_claim_packed_flex \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s17g_data_1b_flex.json" > /tmp/speed_s17g.log 2>&1
            finish_bench s17g ;;
    s17h)   # Later (~8 min; ours' first run compiles ~170 s on a fresh machine): the 1B curves again, each
            # side twice (preset curves, 2 reps): the 1B stock-against-stock spread s16a did not have.
            timeout 520 python3 scripts/bench_recipes.py --preset curves --cases full_1b_curve \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s17h_curves_full_1b.json" > /tmp/speed_s17h.log 2>&1
            finish_bench s17h ;;
    s17i)   # Later (~8 min; each new ours graph compiles ~170 s on a fresh machine): the 1B claim with
            # grouped-query k/v handed to SDPA unexpanded (bench hook BENCH_SDPA_GQA: ~0.75 GiB of
            # expanded copies fewer saved for backward?) once, beside the claim and stock (2 alternating
            # reps each; the peak memory is the same every run).
            timeout 560 python3 scripts/bench_recipes.py --cases full_1b --reps 2 \
              --only stock_best,ours_best_model_fast_mlp8_l1,ours_claim_gqa \
              --work /tmp/bw --run-timeout 300 --out "$OUT/s17i_gqa_full_1b.json" > /tmp/speed_s17i.log 2>&1
            finish_bench s17i ;;
    s16g)   # (run 2026-12-02 as the session's last call, ~2 min after s16e on the same machine: its 8B
            # checkpoint) stock's lora_8b_curve once more: the stock-against-stock spread of the curve.
            ensure_ckpt8b
            timeout 290 python3 scripts/bench_recipes.py --cases lora_8b_curve --only stock_best --reps 1 \
              --work /tmp/bw --run-timeout 270 --out "$OUT/s16g_curve_lora_8b_stock_repeat.json" > /tmp/speed_s16g.log 2>&1
            finish_bench s16g ;;
    s15b)   # Next (~8 min, right after s15a on the same warm machine, whose best + fp8_mlp_layers 1
            # rows it is read against): CUDA graphs now that the step has no host sync (s14c: +0.8%
            # with it; its compile takes ~2 min), and per-layer compile + FP8 + fast accumulation
            # (s14b: 78,851 tok/s at 15.00 GiB over 220 steps), 2 alternating reps.
            timeout 580 python3 scripts/bench_recipes.py --cases full_1b \
              --only ours_best_model_fast_mlp8_l1_cg,ours_fused_fp8_fastacc \
              --reps 2 --work /tmp/bw --run-timeout 200 --out "$OUT/s15b_full_1b.json" > /tmp/speed_s15b.log 2>&1
            finish_bench s15b ;;
    where8b) # Issue #15 next: where each side's best 8B LoRA step spends its GPU time (profiled steps 7-9).
            ensure_ckpt8b
            timeout 400 python3 scripts/bench_recipes.py --cases lora_8b --reps 1 --work /tmp/bw \
              --only stock_best_profiled,ours_fp8_embcpu_profiled --run-timeout 200 \
              --out "$OUT/profiled_lora_8b.json" > /tmp/where8b_prof.log 2>&1
            python3 scripts/trace_summary.py --top 80 /tmp/bw/prof_stock_best_8b /tmp/bw/prof_ours_fp8_embcpu_8b > /tmp/where8b_traces.txt 2>&1
            tar czf "$OUT/where8b.tgz" /tmp/where8b*.log /tmp/where8b_traces.txt /tmp/bw/lora_8b_*profiled*.log 2>/dev/null
            grep -h "rror" /tmp/where8b_prof.log | cut -c1-250; cut -c1-150 /tmp/where8b_traces.txt ;;
    offload) timeout 120 python3 -m tune_recipes run --nproc_per_node 2 full_finetune_distributed --config tiny/full_distributed \
              device=cuda dtype=bf16 max_steps_per_epoch=3 output_dir=/tmp/fs_offload log_peak_memory_stats=True \
              fsdp_cpu_offload=True > /tmp/offload.log 2>&1; echo "fsdp_cpu_offload rc=$? $(tail -1 /tmp/fs_offload/metrics.jsonl | cut -c1-200)"; grep -m5 "rror" /tmp/offload.log ;;
    tpsmoke) # Tensor parallelism over NCCL: 2 GPUs at tp=2 (one data-parallel group, so the same batches as
            # 1 process), eager and compiled, beside 1 process; fp32 so the losses can be compared.
            plan="tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan"
            for run in "1:tensor_parallel_dim=1" "2:tensor_parallel_dim=2 $plan" "2:tensor_parallel_dim=2 $plan compile=True"; do
              n=${run%%:*}; extra=${run#*:}; tag=$(echo "$n $extra" | tr -c 'a-z0-9\n' _ | cut -c1-30)$(echo $extra | grep -c compile)
              timeout 150 python3 -m tune_recipes run --nproc_per_node $n full_finetune_distributed --config tiny/full_distributed \
                device=cuda dtype=fp32 max_steps_per_epoch=4 output_dir=/tmp/tp_$tag $extra > /tmp/tp_$tag.log 2>&1
              rc=$?; echo "nproc $n ${extra%% tensor_parallel_plan*} $(echo $extra | grep -o compile=True) rc=$rc losses: $(grep -o '"loss": [0-9.]*' /tmp/tp_$tag/metrics.jsonl | cut -c9-18 | tr '\n' ' ')"
              grep -m3 "rror" /tmp/tp_$tag.log
            done ;;
    ckpt8b) CUDA_VISIBLE_DEVICES=$(( $(nvidia-smi -L | wc -l) - 1 )) python3 scripts/make_random_checkpoint.py \
              --builder torchtune.models.llama3_1.llama3_1_8b --out /tmp/bw/ckpt_lora_8b > /tmp/ckpt8b.log 2>&1 & ;;
    smoke)  for r in full lora; do
              timeout 300 python3 -m tune_recipes run ${r}_finetune_single_device --config tiny/${r}_single_device \
                device=cuda dtype=bf16 max_steps_per_epoch=5 output_dir=/tmp/smoke_$r log_peak_memory_stats=True 2>&1 | tail -3
              tail -1 /tmp/smoke_$r/metrics.jsonl
            done 2>&1 | tee "$OUT/smoke.txt" ;;
    dsmoke) { for r in full_finetune_distributed:full lora_finetune_distributed:lora qat_distributed:qat \
                 qat_lora_finetune_distributed:qat_lora knowledge_distillation_distributed:kd; do
              timeout 240 python3 -m tune_recipes run --nproc_per_node ${NPROC:-2} ${r%%:*} --config tiny/${r##*:}_distributed \
                device=cuda dtype=bf16 max_steps_per_epoch=3 output_dir=/tmp/ds_${r##*:} log_peak_memory_stats=True > /tmp/ds_${r##*:}.log 2>&1
              echo "${r%%:*} rc=$? $(tail -c 300 /tmp/ds_${r##*:}/metrics.jsonl 2>/dev/null | tail -1 | cut -c1-160)"
              grep -m3 "Error" /tmp/ds_${r##*:}.log
            done
            for r in qat_single_device:qat_single_device knowledge_distillation_single_device:kd_single_device; do
              timeout 240 python3 -m tune_recipes run ${r%%:*} --config tiny/${r##*:} device=cuda dtype=bf16 \
                max_steps_per_epoch=3 output_dir=/tmp/ss_${r##*:} > /tmp/ss_${r##*:}.log 2>&1
              echo "${r%%:*} rc=$? $(tail -1 /tmp/ss_${r##*:}/metrics.jsonl 2>/dev/null | cut -c1-160)"
              grep -m3 "Error" /tmp/ss_${r##*:}.log
            done; } 2>&1 | tee "$OUT/dsmoke.txt" ;;
    accept) # NOTE: the bench steps' checkpoints (/tmp/bw: 8B 15 GiB, 1B 2.3 GiB) go first. With them
            # a full pass (8B and 7B checkpoints, an 8B quantize) filled this machine's 64 GiB disk
            # on 2026-12-02 (8B quantize and Qwen 7B LoRA failed); a later bench step rebuilds them.
            rm -rf /tmp/bw/ckpt_* /tmp/bench_recipes/ckpt_*; df -h /tmp | tail -1
            python3 scripts/gpu_acceptance.py --kind single --lanes "${LANES:-1}" --steps "${STEPS:-5}" \
              ${CONFIGS:+--configs "$CONFIGS"} --out "$OUT/acceptance_single.json" 2>&1 | grep -v "^{" | tail -30
            tar czf "$OUT/acceptance_single_logs.tgz" -C /tmp/acceptance logs configs 2>/dev/null ;;
    daccept) python3 scripts/gpu_acceptance.py --kind distributed --nproc 2 --steps "${STEPS:-5}" \
              ${CONFIGS:+--configs "$CONFIGS"} --out "$OUT/acceptance_distributed.json" 2>&1 | grep -v "^{" | tail -30
            tar czf "$OUT/acceptance_distributed_logs.tgz" -C /tmp/acceptance logs configs 2>/dev/null ;;
    profile) test -f /tmp/bench_recipes/ckpt_full_1b/model.safetensors || python3 scripts/make_random_checkpoint.py \
              --builder torchtune.models.llama3_2.llama3_2_1b --out /tmp/bench_recipes/ckpt_full_1b
            python3 scripts/profile_recipes.py --ckpt /tmp/bench_recipes/ckpt_full_1b --steps 8 --out /tmp/prof --order ${ORDER:-stock,ours} \
              > "$OUT/profile.txt" 2>&1; grep -A 16 "=====" "$OUT/profile.txt" | cut -c1-150 ;;
    scale)  python3 scripts/bench_scale_grads.py "$OUT/scale_grads.json" 2>&1 | tail -12 ;;
    fused)  python3 scripts/bench_fused_ce.py --out "$OUT/fused_ce.json" 2>&1 | grep -v "Warning\|quant_api\|Skipping" | tail -45 ;;
    fp8lora) # Issue #15 lever, one GPU, < 9 min: LoRA's frozen base projections in FP8
            # (tune_recipes/modules/fp8_lora.py). The 8B checkpoint builds in the background while
            # the module's GPU tests run (untimed); then 8B LoRA bf16 (ours_best) vs FP8, 20 steps
            # each, and the 120-step FP8 vs bf16 loss curve (lora_8b_curve), one after another.
            ensure_ckpt8b &  # in the background
            timeout 240 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_fp8_lora.py \
              tests/recipes/test_fp8_lora_recipe.py 2>&1 | grep -v "Warning\|warn" | tail -15 | tee "$OUT/fp8lora_tests.txt"
            wait  # the checkpoint
            bench_on 0 lora_8b,lora_8b_curve ours_best,ours_fused,ours_fused_fp8 1 fp8lora_8b
            wait; finish_bench fp8lora ;;
    fp8lora8b) # fp8lora in two calls of < 10 min on one GPU. This one: the 8B checkpoint (background)
            # beside the FP8 LoRA GPU tests, then 8B LoRA stock / ours bf16 / ours FP8, one run each.
            ensure_ckpt8b &  # in the background
            timeout 200 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_fp8_lora.py \
              tests/recipes/test_fp8_lora_recipe.py 2>&1 | grep -v "Warning\|warn" | tail -15 | tee "$OUT/fp8lora_tests.txt"
            wait
            bench_on 0 lora_8b stock_best,ours_best,ours_fused_fp8 1 fp8lora_8b
            wait; finish_bench fp8lora ;;
    curves1b) # The other call (machine still warm: the 8B checkpoint reused): the 120-step FP8 LoRA
            # curve, then 1B stock / ours best / ours best with the whole model compiled.
            bench_on 0 lora_8b_curve ours_fused,ours_fused_fp8 1 curve_lora_8b; wait
            bench_on 0 full_1b stock_best,ours_best,ours_best_model 1 heads1b_full_1b; wait
            finish_bench curve_lora_8b; finish_bench heads1b ;;
    lag1b)  # Issue #15 (2026-12-01): the one-step logging lag on 1B. Its GPU test, then stock /
            # ours best / ours best waiting at each logged step, 2 alternating reps; then ours
            # best with the whole model compiled, one rep.
            timeout 120 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/training/reporting/test_progress.py \
              2>&1 | grep -v "Warning\|warn" | tail -4 | tee "$OUT/lag_tests.txt"
            bench_on 0 full_1b stock_best,ours_best,ours_best_sync 2 lag1b_full_1b; wait
            bench_on 0 full_1b ours_best_model 1 lag1b_model_full_1b; wait
            finish_bench lag1b ;;
    sac8b)  # Issue #15 (2026-12-01): 8B LoRA with the logging lag: stock / ours FP8 / ours FP8 +
            # checkpointing every 10th layer (3 of 32), one run each, after the reporter's GPU test.
            timeout 120 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/training/reporting/test_progress.py \
              2>&1 | grep "passed\|failed\|Error\|assert" | tail -6 | tee "$OUT/lag_tests.txt"
            ensure_ckpt8b
            bench_on 0 lora_8b stock_best,ours_fused_fp8,ours_fused_fp8_sac 1 sac8b_lora_8b
            wait; finish_bench sac8b ;;
    embcpu8b) # Issue #15, next: 8B LoRA memory levers beside stock and FP8 alone, one run each
            # (~5 min with the checkpoint build): embedding in CPU memory, + 2 checkpointed layers.
            timeout 150 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_host_embedding.py \
              2>&1 | grep "passed\|failed\|Error\|assert" | tail -6 | tee "$OUT/embcpu_tests.txt"
            ensure_ckpt8b
            bench_on 0 lora_8b stock_best,ours_fused_fp8,ours_fused_fp8_embcpu,ours_fused_fp8_embcpu_sac16 1 embcpu8b_lora_8b
            wait; finish_bench embcpu8b ;;
    fp8mlp8b) # Issue #15, next: 8B LoRA FP8 with the MLP activations in FP8 (speed, memory under
            # compile), beside stock and FP8 alone; then its 120-step curve needs lora_8b_curve.
            ensure_ckpt8b
            bench_on 0 lora_8b stock_best,ours_fused_fp8,ours_fused_fp8_mlp8 1 fp8mlp8b_lora_8b
            wait; finish_bench fp8mlp8b ;;
    mem8b)  # Issue #15 (session 8): the two untried 8B LoRA memory levers on the GPU. Their GPU tests,
            # then stock / FP8 / FP8 + MLP activations in FP8 / + embedding in CPU memory / both,
            # one run each (~6 min with the checkpoint build). curve8b reuses the checkpoint.
            timeout 150 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA tests/unit/modules/test_host_embedding.py \
              tests/unit/modules/test_fp8_mlp.py 2>&1 | grep "passed\|failed\|Error\|assert" | tail -8 | tee "$OUT/mem8b_tests.txt"
            ensure_ckpt8b
            bench_on 0 lora_8b stock_best,ours_fused_fp8,ours_fused_fp8_mlp8,ours_fused_fp8_embcpu,ours_fused_fp8_mlp8_embcpu 1 mem8b_lora_8b
            wait; finish_bench mem8b ;;
    curve8b) # The 220-step 8B LoRA curves at lr 1e-3: bf16 / FP8 base / FP8 base + MLP activations in FP8.
            ensure_ckpt8b
            bench_on 0 lora_8b_curve ours_fused,ours_fused_fp8,ours_fused_fp8_mlp8 1 curve8b_lora_8b
            wait; finish_bench curve8b ;;
    fp8loramodel) # 8B LoRA FP8 with the whole model compiled (one run; the others: fp8lora8b).
            ensure_ckpt8b
            bench_on 0 lora_8b ours_fused_fp8_model 1 fp8loramodel_8b
            wait; finish_bench fp8loramodel ;;
    recipes) python3 scripts/bench_recipes.py --cases "${CASES:-full_1b}" --order "${RECIPES_ORDER:-stock-first}" --out "$OUT/recipes.json" 2>&1 | grep -v "^{" | tail -12 ;;
  esac
  kill $smi_pid 2>/dev/null
done
