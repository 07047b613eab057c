#!/usr/bin/env bash
# The README's CLI pipelines, the three of them at once (each is small; on a GPU machine they
# share the card), with the wall time of every command. Held-out curves are in each run
# folder's metrics.jsonl; benchmarks/curves.py prints them beside the CPU's recorded ones.
#   bash benchmarks/pipelines.sh OUTDIR [PPO_STEPS]
set -u
out=${1:?usage: pipelines.sh OUTDIR [PPO_STEPS]}
steps=${2:-600}
mkdir -p "$out"
timed() {  # name, then the refppo arguments
    local name=$1; shift
    local start=$EPOCHREALTIME
    python3 -m refppo "$@" trainer.output_dir="$out/$name" trainer.progress_bar=false > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc wall_s=$(python3 -c "print(round($EPOCHREALTIME - $start, 1))")" | tee -a "$out/times.txt"
}
(
    timed sft sft
    timed ppo ppo model.path="$out/sft/model" trainer.total_training_steps="$steps" &
    timed grpo ppo model.path="$out/sft/model" algorithm.adv_estimator=grpo rollout.n=8 data.train_batch_size=16 \
        actor.ppo_mini_batch_size=8 trainer.total_training_steps="$steps" &
    wait
) &
(
    timed psft sft data.task=preference model.hidden_size=64 sft.steps=150
    timed prm rm data.task=preference model.path="$out/psft/model" rm.steps=250 rm.lr=5e-4
    timed pppo ppo data.task=preference model.path="$out/psft/model" reward_model.enable=true \
        reward_model.model.path="$out/prm/model" algorithm.use_kl_in_reward=true algorithm.kl_ctrl.kl_coef=0.05 \
        data.max_response_length=10 reward_model.missing_eos_penalty=3 trainer.total_training_steps=400
) &
wait
