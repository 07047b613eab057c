"""The update phase with the value checks once per step (refppo) vs in every micro-batch (before).

Each loss checks its inputs' values (0/1 mask, finite tensors) with one host sync; run in every
micro-batch, that is 2-3 syncs per micro-batch, each of which stalls a GPU's queue. The trainer
checks the evaluated batch once and runs its update loop inside ``value_checks(False)``. This
times ``PPOTrainer.update`` on one evaluated batch, alternating the two, median of ``--repeats``.

Usage: python benchmarks/bench_value_checks.py [--workload W2] [--micro 4] [--repeats 7] [--device cpu|cuda]
"""

import argparse
import contextlib
import statistics

import torch
from bench_ppo_step import WORKLOADS, build

import refppo.training.trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    micro = [f"{role}.ppo_micro_batch_size_per_gpu={args.micro}" for role in ("actor", "critic")]
    trainer = build(args.workload, args.device, extra=tuple(micro))
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})
    once = refppo.training.trainer.value_checks
    every = lambda enabled: contextlib.nullcontext()  # noqa: E731  the checks stay on inside the loop
    times = {"once per step": [], "every micro-batch": []}
    for i in range(2 * args.repeats + 2):
        name = "once per step" if i % 2 == 0 else "every micro-batch"
        refppo.training.trainer.value_checks = once if i % 2 == 0 else every
        timing = {}
        trainer.update(batch, timing)
        if i >= 2:  # the first pair warms up
            times[name].append(timing["timing_s/update_critic"] + timing["timing_s/update_actor"])
    refppo.training.trainer.value_checks = once
    rows = batch["response_mask"].shape[0]
    print(
        f"{args.workload} {args.device}, {rows} rows, micro-batches of {args.micro}: update (critic + actor), median "
        f"of {args.repeats}"
    )
    for name, t in times.items():
        print(
            f"  checks {name:18s} {statistics.median(t) * 1e3:8.1f} ms  (min {min(t) * 1e3:.1f}, max "
            f"{max(t) * 1e3:.1f})"
        )
    ratio = statistics.median(times["every micro-batch"]) / statistics.median(times["once per step"])
    print(f"  every micro-batch / once per step: {ratio:.3f}")


if __name__ == "__main__":
    main()
