#!/bin/bash
# old (1352334, a git worktree) against new (HEAD), alternating invocations, refppo alone, one thread
cd /work/main/benchmarks
source /work/venv/bin/activate
for wl in W1 W2; do
  steps=5; rounds=3
  if [ $wl = W2 ]; then steps=3; rounds=2; fi
  for r in $(seq 1 $rounds); do
    for side in old new; do
      if [ $side = old ]; then pp=/tmp/old_wt; else pp=/work/main; fi
      PYTHONPATH=$pp python bench_ppo_step.py --workloads $wl --impls refppo --rounds 1 --steps $steps --threads 1 --json /tmp/ab/${wl}_${side}_$r.json > /tmp/ab/${wl}_${side}_$r.log 2>&1
      echo "$wl $side $r rc=$?"
    done
  done
done
