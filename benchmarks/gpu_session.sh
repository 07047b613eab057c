#!/usr/bin/env bash
# One lent GPU call: verl's quickstart shape Q with the candidate CUDA settings side by side in one
# process (ab_step.py), then one profiled step of the likely default, then the gpu tests in the
# time left. Every part has its own time limit, so the call
# ends inside the device's 10 minutes; what each part measured lands in $OUT (the JSON is
# rewritten after every step).
#
# Usage (on the device, from the repository root): OUT=dir COMMIT=sha bash benchmarks/gpu_session.sh [rounds]
set -u
cd "$(dirname "$0")/.."
rounds=${1:-3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the device's pip install -e . left refppo unimportable
start=$SECONDS
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"


cd benchmarks
# Q with the CUDA defaults (compiled layers and log-probs, CUDA-graph decoding) and micro-batches
# sized to the card, against log-softmax blocks of 256M and 1G elements (the compiled kernel read
# 441-row blocks at about 80 GB/s on the H100 of 2026-11-27: more rows per block, more of the card
# at work), the eager blocks at 256M (their float32 copies stay under the card's memory), and wider
# scoring passes. The layers stay compiled in every variant: switching them re-traces the decoder.
big="rollout.log_prob_micro_batch_size_per_gpu=32 ref.log_prob_micro_batch_size_per_gpu=32 reward_model.micro_batch_size_per_gpu=32"
big="$big critic.ppo_micro_batch_size_per_gpu=16 actor.ppo_micro_batch_size_per_gpu=16"
timeout $((450 - (SECONDS - start))) python ab_step.py --workload Q --rounds "$rounds" \
    --variant "layers=$big" --variant "chunk1g=$big chunk_elements=1073741824" \
    --variant "chunk256=$big chunk_elements=268435456" \
    --variant "eager256=$big chunk_elements=268435456 actor.use_torch_compile=false" \
    --variant "wide1g=${big//=32/=64} chunk_elements=1073741824" \
    --json "$OUT/ab_q.json" --record chunk1g --record-json "$OUT/q_step.json" \
    --profile chunk1g --commit "${COMMIT:-unknown}" rollout.cuda_graphs=true 2>&1 | grep -v "^USDT" | tee "$OUT/ab_q.txt"
cd ..
echo "Q done at $((SECONDS - start)) s"

# The gpu tests (the book's plugins are absent there: no nbval, no nbformat).
left=$((560 - (SECONDS - start)))
if [ "$left" -gt 20 ] && [ "${TESTS:-1}" = 1 ]; then
    timeout "$left" python -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests \
        --ignore tests/test_assert_margins.py 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
fi
echo "done at $((SECONDS - start)) s"
