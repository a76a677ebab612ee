#!/usr/bin/env bash
# The GPU batch: GPU tests and every benchmark in one call on the device machine, logs under $OUT.
#   source .whl/prelude.sh && bash bench/gpu_suite.sh [part ...]
#   parts: env calibrate tests megatron megatron_moe attn tail partial heavy_tail heavy_beside heavy_keep contention adamw train gen gen_fp8 attn_fp8 agent agent_queued agent_noevict agent_waves reshard grpo grpo_long recipe ppo placement async2 lora moe
# Env: EXTRA (overrides for the PPO parts), RECIPE_PRESET (qwen3-0.6b), RECIPE_STEPS (5), RECIPE_WARMUP (2), RECIPE_TAG, GRPO_MODES, GRPO_TAG (suffix of the grpo record), GEN_VARIANTS, GEN_ENGINE,
#      GEN_BATCHES, GEN_ARGS (more bench.generate flags, e.g. --n 8), TRAIN_ARGS (replaces --sweep), PROFILE=N (the GRPO parts profile step N into $OUT/runs/*/profile, summaries copied to $OUT/profile_*.json,
#      bench.train_step adds --profile), PLACEMENT_MODES (space-separated), PLACEMENT_WARMUP,
#      ADAMW_SWEEP (CHUNK:BLOCK:warps list for bench.adamw), ASYNC2_STEPS (10), AGENT_ARGS (more bench.agent_turns flags for agent_queued, e.g. --continuation-wait-steps 2), T_<PART> (time limits, s; T_PLACEMENT
#      and T_ASYNC2 are per mode), HEAVY_STEPS (9) / HEAVY_WARMUP (3) for the heavy_* parts, PARTITIONS (contention).
# Each part has its own time limit so one failure cannot eat the lease; the last line of each log is
# the benchmark's JSON. All logs are packed into $OUT/logs.tar.gz; a summary goes to $OUT/summary.jsonl.
set -u
OUT=${OUT:-/tmp/hybridrl_out}
mkdir -p "$OUT/logs"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env tests train gen reshard grpo ppo placement)
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
prof_grpo=(); prof_train=()
# the heavy-tail runs: 9 steps, the first 3 (two compile) not measured: the partial modes reach their steady state
heavy=(--steps "${HEAVY_STEPS:-9}" --warmup "${HEAVY_WARMUP:-3}" --runs-dir "$OUT/runs")
# the long single-run parts keep their run directories (the launcher's log: how far a run got when its time limit ended it)
keep_runs=(--runs-dir "$OUT/runs")
if [ -n "${PROFILE:-}" ]; then
  prof_grpo=(--runs-dir "$OUT/runs" "trainer.profile_steps=[$PROFILE]"); prof_train=(--profile)
fi
run() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  local last; last=$(grep -E '^\{' "$OUT/logs/$name.log" | tail -1)
  python3 - "$name" "$rc" "$((SECONDS - t0))" "$last" >> "$OUT/summary.jsonl" <<'PY'
import json, sys
name, rc, secs, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    result = json.loads(last) if last else None
except json.JSONDecodeError:
    result = None
print(json.dumps({"part": name, "rc": rc, "seconds": secs, "result": result}))
PY
  echo "== $name rc=$rc ${SECONDS}s: $(tail -c 300 "$OUT/logs/$name.log" | tr '\n' ' ')"
}
for p in "${parts[@]}"; do
  case $p in
    env) run env "${T_ENV:-90}" python3 -m bench.env_check ;;
    calibrate)  # the cost model's calibration of this machine type (h100 or h200), results kept under $OUT
      name=$(python3 -c "import torch; from launcher.planning.costmodel import MACHINES as M
n = torch.cuda.get_device_name(); print(next(m for part, m in M.items() if part in n))")
      run "calibrate_$name" "${T_CALIBRATE:-480}" python3 -m bench.calibrate --name "$name" \
        --out "$OUT/calibration_$name.json" --workdir "$OUT/calibrate_$name" ;;
    tests) run tests "${T_TESTS:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 240 ${TESTS:-tests} ;;
    megatron) run megatron_tests "${T_MEGATRON:-300}" python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 240 \
                tests/parallel/test_megatron_gpu.py tests/ppo/test_trainer_megatron.py ;;
    megatron_moe) run megatron_moe_tests "${T_MEGATRON_MOE:-540}" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
                --timeout 420 tests/parallel/test_megatron_moe_gpu.py ;;
    attn) run decode_attention "${T_ATTN:-240}" python3 -m bench.decode_attention --batches 32,64,256 --contexts 256,384 ;;
    tail) run decode_tail "${T_TAIL:-90}" python3 -m bench.decode_tail --batches 32,64,256 ;;
    heavy_tail) run heavy_tail_sync "${T_HEAVY_TAIL:-540}" python3 -m bench.heavy_tail --modes colocated-sync "${heavy[@]}"
      run heavy_tail_partial "${T_HEAVY_TAIL:-540}" python3 -m bench.heavy_tail --modes colocated-partial "${heavy[@]}" ;;
    heavy_beside) run heavy_tail_beside_keep "${T_HEAVY_TAIL:-540}" python3 -m bench.heavy_tail \
      --modes colocated-partial-beside-keep "${heavy[@]}"
      run heavy_tail_beside "${T_HEAVY_TAIL:-540}" python3 -m bench.heavy_tail --modes colocated-partial-beside \
        "${heavy[@]}" ;;
    heavy_keep) run heavy_tail_partial_keep "${T_HEAVY_TAIL:-540}" python3 -m bench.heavy_tail \
      --modes colocated-partial-keep "${heavy[@]}" ;;
    # a decode step beside training-like loads, the load kept off SMs by a CUDA green context or cuBLASLt's carveout
    contention) run beside_contention "${T_CONTENTION:-240}" python3 -m bench.beside_contention --model llama-1b \
      --rows 64 --seconds 1.5 --loads none,gemm,train --priorities=-100 --switch-intervals 0.0001 \
      --partitions "${PARTITIONS:-none,green:116,green:100,carveout:16,carveout:32}" ;;
    partial) run partial_rollouts "${T_PARTIAL:-540}" python3 -m bench.partial_rollouts --model llama-1b \
      --prompts 32 --n 8 --prompt-len 128 --max-tokens 4096 --steps 6 --warmup 1 --over 2 --max-staleness 1 ;;
    adamw) for case in masters:bf16 masters:fp32 bf16:bf16; do  # layout:grads
             run "adamw_${case/:/_}" "${T_ADAMW:-120}" python3 -m bench.adamw --model llama-1b --layout "${case%:*}" \
               --grads "${case#*:}" ${ADAMW_SWEEP:+--sweep $ADAMW_SWEEP}
           done ;;
    train) run train_step "${T_TRAIN:-300}" python3 -m bench.train_step --model llama-1b --seq 2048 --batch 4 \
             ${TRAIN_ARGS:---sweep} "${prof_train[@]}" ;;
    gen) run generate "${T_GEN:-400}" python3 -m bench.generate --model llama-1b --prompt-len 128 --new-tokens 256 \
           --engine "${GEN_ENGINE:-both}" --batches "${GEN_BATCHES:-32,64,256}" --hf-cache dynamic --native-variants "${GEN_VARIANTS:-auto,triton+compile}" ${GEN_ARGS:-} ;;
    gen_fp8)  # issue 39: the fp8 KV cache's decode against bf16 at the Qwen3-0.6B shape, 256 rows
      run generate_fp8 "${T_GEN_FP8:-400}" python3 -m bench.generate --model qwen3-0.6b --batches 256 --engine native \
        --native-variants auto+compile,auto+compile+fp8 --prompt-len 128 --new-tokens 256 --no-profile --repeats 2 ;;
    attn_fp8)  # the fp8 cache's tiles: the recipe's shared-prompt launch (640 rows in groups of 5) over tiles and caps
      run decode_attention_fp8 "${T_ATTN_FP8:-300}" python3 -m bench.decode_attention --kv-dtype fp8 --batches 640 \
        --contexts 600 --no-sweep --samples-per-prompt 5 --prompt-len 80 --sweep-shared \
        --shared-tiles 64:4:2,64:4:1,32:4:2,32:4:3,128:4:1 --maxnreg 96,128,168 ;;
    reshard) [ "$ngpu" -ge 2 ] && run reshard "${T_RESHARD:-180}" torchrun --standalone --nproc_per_node 2 -m bench.reshard \
               --model llama-1b --train-tp 2 --gen-tp 1 --verify --device cuda ;;
    grpo) run "grpo_a${GRPO_TAG:-}" "${T_GRPO:-420}" python3 -m bench.placement --config conf/bench_grpo_1b.yaml \
            --nproc 1 --warmup 3 --modes "${GRPO_MODES:-colocated-sync}" "${prof_grpo[@]}" ${EXTRA:-} ;;
    grpo_long) run "grpo_long${GRPO_TAG:-}" "${T_GRPO_LONG:-420}" python3 -m bench.placement --config conf/bench_grpo_1b.yaml \
                 --nproc 1 --warmup 2 --modes colocated-sync "${prof_grpo[@]}" data.task=random:256 \
                 data.max_prompt_length=256 rollout.max_response_length=1024 trainer.total_steps=5 \
                 actor.max_tokens_per_micro_batch=36864 ref.max_tokens_per_micro_batch=36864 ${EXTRA:-} ;;
    recipe)  # conf/grpo_gsm8k_qwen3.yaml at its defaults on a random model of the preset's shape (bench.recipe_fixture)
      fx=/tmp/recipe_${RECIPE_PRESET:-qwen3-0.6b}
      [ -d "$fx/model" ] || python3 -m bench.recipe_fixture --preset "${RECIPE_PRESET:-qwen3-0.6b}" --out "$fx" \
        > "$OUT/logs/recipe_fixture.json"
      run "recipe_${RECIPE_PRESET:-qwen3-0.6b}${RECIPE_TAG:-}" "${T_RECIPE:-560}" python3 -m bench.placement \
        --config conf/grpo_gsm8k_qwen3.yaml --nproc 1 --warmup "${RECIPE_WARMUP:-2}" --modes colocated-sync "${prof_grpo[@]}" \
        model.path="$fx/model" "data.train_files=[$fx/data/train.parquet]" "data.val_files=[]" \
        trainer.val_before_train=false trainer.test_freq=0 trainer.total_epochs=0 \
        trainer.total_steps="${RECIPE_STEPS:-5}" ${EXTRA:-} ;;
    moe)  # GRPO (a) with Qwen3-30B-A3B's layers cut to 6 (conf/bench_grpo_moe.yaml), then its decode vs the roofline
      run grpo_moe "${T_MOE:-540}" python3 -m bench.placement --config conf/bench_grpo_moe.yaml --nproc 1 --warmup 2 \
        --modes colocated-sync "${keep_runs[@]}" "${prof_grpo[@]}" ${EXTRA:-}
      run generate_moe "${T_GEN_MOE:-400}" python3 -m bench.generate --model qwen3-30b-a3b-6l --prompt-len 128 \
        --new-tokens 256 --engine native --batches 32,256 --native-variants auto,auto+compile ;;
    ppo) run ppo_1gpu "${T_PPO:-420}" python3 -m bench.ppo_step --config conf/bench_ppo_1b.yaml --nproc 1 ${EXTRA:-} ;;
    placement)  # one process and one time limit per mode: a slow mode cannot cost the others their numbers
      [ "$ngpu" -ge 2 ] && for m in ${PLACEMENT_MODES:-colocated-sync split-sync split-async split-async+controller}; do
        run "placement_b_${m/+/_}" "${T_PLACEMENT:-280}" python3 -m bench.placement --config conf/bench_ppo_1b.yaml \
          --nproc 2 --warmup "${PLACEMENT_WARMUP:-2}" --modes "$m" ${EXTRA:-}
      done ;;
    async2)  # issue 41 item 6: PPO workload (b), split placement, synchronous vs staleness bound 1 vs 2 (2 GPUs).
             # 10 steps (2 warm-up): the last K steps generate nothing; compare samples_per_s_steady
      [ "$ngpu" -ge 2 ] && for m in split-sync split-async split-async2; do
        run "async2_b_${m}" "${T_ASYNC2:-420}" python3 -m bench.placement --config conf/bench_ppo_1b.yaml \
          --nproc 2 --warmup 2 --modes "$m" trainer.total_steps="${ASYNC2_STEPS:-10}" ${EXTRA:-}
      done ;;
    lora)  # issue 43: GRPO (a) with rank-64 all-linear LoRA, llama-7b (vs 20.0 samples/s full-parameter) and a
           # Qwen3-14B shape (impossible at full parameters), one H200 each; the full 7B run beside it: LORA_FULL=1.
           # actor.lora.sync=auto in both (its choice: the JSON's lora_sync); LORA_SYNC=1 adds the 7B run with the
           # other mode forced (engine_bytes per step: merged weights every update vs the adapters after the first)
      run grpo_7b_lora "${T_LORA:-540}" python3 -m bench.placement --config conf/bench_grpo_7b_lora.yaml --nproc 1 \
        --warmup 2 --modes colocated-sync "${keep_runs[@]}" "${prof_grpo[@]}" ${EXTRA:-}
      [ -n "${LORA_SYNC:-}" ] && run grpo_7b_lora_adapters "${T_LORA:-540}" python3 -m bench.placement \
        --config conf/bench_grpo_7b_lora.yaml --nproc 1 --warmup 2 --modes colocated-sync actor.lora.sync=adapters \
        ${EXTRA:-}
      run grpo_qwen3_14b_lora "${T_LORA:-540}" python3 -m bench.placement --config conf/bench_grpo_qwen3_14b_lora.yaml \
        --nproc 1 --warmup 1 --modes colocated-sync "${keep_runs[@]}" "${prof_grpo[@]}" ${EXTRA:-}
      [ -n "${LORA_FULL:-}" ] && run grpo_7b "${T_LORA:-540}" python3 -m bench.placement --config conf/bench_grpo_7b.yaml \
        --nproc 1 --warmup 2 --modes colocated-sync ${EXTRA:-} ;;
    agent) run agent_turns "${T_AGENT:-540}" python3 -m bench.agent_turns --model qwen3-0.6b --trajectories 256 \
             --turns 3 --turn-tokens 128 --tool-delay-ms 200 --device cuda --dtype bfloat16 ;;
    # an RL step's trajectories outnumbering the decode slots: the rest queue; sleeping trajectories' KV in park slots
    agent_queued) run agent_turns_queued "${T_AGENT_QUEUED:-300}" python3 -m bench.agent_turns --model qwen3-0.6b \
             --trajectories 1024 --max-num-seqs 256 --tool-workers 1024 --turns 3 --turn-tokens 128 \
             --tool-delay-ms 200 --device cuda --dtype bfloat16 ${AGENT_ARGS:-} ;;
    # the same, kept KV only, new trajectories waiting for a slot instead of evicting a parked one (RolloutConfig)
    agent_noevict) run agent_turns_queued_noevict "${T_AGENT_QUEUED:-300}" python3 -m bench.agent_turns \
             --model qwen3-0.6b --trajectories 1024 --max-num-seqs 256 --tool-workers 1024 --turns 3 --turn-tokens 128 \
             --tool-delay-ms 200 --device cuda --dtype bfloat16 --modes keep --no-evict-parked-for-new ${AGENT_ARGS:-} ;;
    # the same two kept-KV runs with single-sequence fresh rows in the graphed continuation waves (RolloutConfig)
    agent_waves) run agent_turns_queued_waves "${T_AGENT_QUEUED:-300}" python3 -m bench.agent_turns \
             --model qwen3-0.6b --trajectories 1024 --max-num-seqs 256 --tool-workers 1024 --turns 3 --turn-tokens 128 \
             --tool-delay-ms 200 --device cuda --dtype bfloat16 --modes keep --fresh-rows-in-waves ${AGENT_ARGS:-}
      run agent_turns_queued_noevict_waves "${T_AGENT_QUEUED:-300}" python3 -m bench.agent_turns \
             --model qwen3-0.6b --trajectories 1024 --max-num-seqs 256 --tool-workers 1024 --turns 3 --turn-tokens 128 \
             --tool-delay-ms 200 --device cuda --dtype bfloat16 --modes keep --no-evict-parked-for-new \
             --fresh-rows-in-waves ${AGENT_ARGS:-} ;;
    *) echo "unknown part $p" ;;
  esac
done
tag=$(IFS=_; echo "${parts[*]}")${GRPO_TAG:-}  # one archive per call: several calls may share $OUT
if [ -n "${PROFILE:-}" ]; then  # the step summaries, at the top of $OUT: deeper files do not come back
  for f in "$OUT"/runs/*/profile/step*_rank*.json; do
    [ -e "$f" ] && cp "$f" "$OUT/profile_${tag}_$(basename "$(dirname "$(dirname "$f")")")_$(basename "$f")"
  done
fi
tar -czf "$OUT/logs_$tag.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
