#!/usr/bin/env bash
# One lent GPU call, in parts run in the order given, each under its own time limit (and all of
# them under TOTAL seconds, default 560) so the call ends inside the device's 10 minutes; what
# each part measured lands in $OUT (at most 8 files come back, so the step lines go to stdout):
#
#   q      verl's quickstart shape Q with the CUDA defaults alone, one process, 3 rounds and a
#          profiled step, and the log-softmax kernel that inductor makes for Q's blocks (whether it
#          splits the rows);
#   ab     Q's candidate settings side by side in one process (ab_step.py), then a profiled step;
#   trl    W3 against TRL, 3 rounds of one step, each side in a fresh process (TRL's wheels
#          carried in .wheels: benchmarks/trl_wheels.sh downloads them);
#   tests  the gpu tests;
#   curve  the README's arithmetic pipeline (SFT, then PPO for 300 steps) with the CUDA defaults,
#          its held-out curve beside the CPU's recorded one. It runs in the background beside the
#          parts after it and is waited for before any timed part (q, ab, trl), which must have
#          the card to themselves.
#
# Usage (on the device, from the repository root):
#   OUT=dir COMMIT=sha [TOTAL=560] bash benchmarks/gpu_session.sh [parts, default q,trl,tests]
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the device's pip install -e . left refppo unimportable
start=$SECONDS
total=${TOTAL:-560}
# seconds a part may take: its own budget or what is left of the total, whichever is less, and at
# least 1, since `timeout 0` would mean no limit at all
limit() {
    local left=$((total - (SECONDS - start)))
    local s=$((left < $1 ? left : $1))
    echo $((s > 1 ? s : 1))
}
pip install -q --no-deps --no-build-isolation -e . >/tmp/install.txt 2>&1 || tail -5 /tmp/install.txt
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Q's micro-batches sized to the card: 32 rows for the scoring passes, 16 for the updates.
big="rollout.log_prob_micro_batch_size_per_gpu=32 ref.log_prob_micro_batch_size_per_gpu=32 reward_model.micro_batch_size_per_gpu=32"
big="$big critic.ppo_micro_batch_size_per_gpu=16 actor.ppo_micro_batch_size_per_gpu=16"

part_q() {
    (cd benchmarks && timeout "$(limit 200)" python ab_step.py --workload Q --rounds 3 --variant "defaults=$big" \
        --json "$OUT/q_defaults.json" --record defaults --record-json "$OUT/q_step.json" --profile defaults \
        --commit "${COMMIT:-unknown}" rollout.cuda_graphs=true 2>&1 | grep -v "^USDT")
    # The compiled log-softmax block at Q's shape (441 rows x 151,936): split reductions or not.
    TORCH_LOGS=output_code timeout "$(limit 60)" python benchmarks/bench_logprobs.py --device cuda \
        --dtype bfloat16 --tokens 16384 --vocab 151936 --pair chunked,compiled --repeats 5 \
        --chunk-elements 67108864 >"$OUT/logprobs_code.txt" 2>&1
    grep -c "def triton_red\|def triton_per" "$OUT/logprobs_code.txt"
    grep -i "split" "$OUT/logprobs_code.txt" | head -3
    tail -4 "$OUT/logprobs_code.txt"
}

part_ab() {
    # The log-softmax's blocks (64M, 1G), the eager blocks, wider scoring passes; the layers stay
    # compiled in every variant (switching them re-traces the decoder).
    (cd benchmarks && timeout "$(limit 450)" python ab_step.py --workload Q --rounds 3 \
        --variant "layers=$big" --variant "chunk1g=$big chunk_elements=1073741824" \
        --variant "eager256=$big chunk_elements=268435456 actor.use_torch_compile=false" \
        --variant "wide=${big//=32/=64}" \
        --json "$OUT/ab_q.json" --profile layers --commit "${COMMIT:-unknown}" rollout.cuda_graphs=true 2>&1 |
        grep -v "^USDT")
}

part_trl() {
    if [ -d .wheels ]; then
        python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl >>/tmp/install.txt 2>&1
    fi
    if PYTHONPATH="$PYTHONPATH:/tmp/site" python -c "import trl" 2>>/tmp/install.txt; then
        (cd benchmarks && PYTHONPATH="$PYTHONPATH:/tmp/site" timeout "$(limit 480)" python bench_ppo_step.py \
            --workloads W3 --impls refppo,trl --rounds 3 --steps 1 --json "$OUT/w3_trl.json" \
            rollout.cuda_graphs=true 2>&1 | grep -v "^USDT")
    else
        tail -3 /tmp/install.txt
        echo "trl does not import (carry .wheels: benchmarks/trl_wheels.sh); W3 against TRL skipped"
    fi
}

part_tests() {
    # The book's plugins are absent there: no nbval, no nbformat.
    timeout "$(limit 300)" python -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests \
        --ignore tests/test_assert_margins.py --durations=5 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
}

part_curve() {
    local runs=/tmp/curve
    mkdir -p "$runs"
    {
        timeout "$(limit 120)" python -m refppo sft trainer.output_dir="$runs/sft" trainer.progress_bar=false \
            >"$runs/sft.log" 2>&1 || tail -5 "$runs/sft.log"
        timeout "$(limit 200)" python -m refppo ppo model.path="$runs/sft/model" trainer.total_training_steps=300 \
            trainer.output_dir="$runs/ppo" trainer.progress_bar=false >"$runs/ppo.log" 2>&1 || tail -5 "$runs/ppo.log"
        python benchmarks/curves.py "$runs"
        tail -3 "$runs/ppo.log"
    } >"$OUT/curve.txt" 2>&1
}

curve_pid=""
wait_for_curve() {
    if [ -n "$curve_pid" ]; then
        wait "$curve_pid"
        curve_pid=""
        echo "curve done at $((SECONDS - start)) s"
        cat "$OUT/curve.txt"
    fi
}

IFS=, read -ra wanted <<<"${1:-q,trl,tests}"
for part in "${wanted[@]}"; do
    case $part in
    curve)
        part_curve &
        curve_pid=$!
        echo "curve started in the background"
        continue
        ;;
    q | ab | trl)
        wait_for_curve
        "part_$part"
        ;;
    tests) part_tests ;;
    *) echo "unknown part $part (q, ab, trl, tests, curve)" ;;
    esac
    echo "$part done at $((SECONDS - start)) s"
done
wait_for_curve
echo "done at $((SECONDS - start)) s"
