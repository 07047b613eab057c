"""Options of one PPO step side by side in one process: variants alternate step by step on one
trainer, so a lent GPU pays the decoder's compilation once, not once per variant.

Each variant is a name and the overrides it adds to the workload's; only settings the trainer
reads at every step may differ between variants (micro-batch sizes and token budgets,
``actor.use_torch_compile``, ``model.use_fused_kernels``,
``algorithm.rollout_correction.bypass_mode``, and ``model.compile_layers``, which compiles or
restores the models' layers as the trainer would), plus ``chunk_elements=N``: the log-softmax's
blocks (rows x vocab elements, ``refppo.accel.logprobs.CHUNK_ELEMENTS``). Every variant gets one
warm-up step (its compilation), then ``--rounds`` rounds of one step each, the variants in turn
(reversed every other round). The weights train on, which does not change a fixed-length step's
work (``rollout.ignore_eos``). The JSON is rewritten after every step, so a run cut short keeps
what it measured. ``--profile NAME`` ends with one profiled step of that variant
(``profile_step.py``'s table); ``--record NAME`` writes that variant's result (after each of its
steps) in ``q_step.json``'s format (``bench_ppo_step.step_record``).

Usage: python benchmarks/ab_step.py --workload Q --variant base= --variant "compiled=actor.use_torch_compile=true"
       [--rounds 3] [--json out.json] [--profile compiled] [--record compiled --record-json q_step.json]
       [--commit SHA] [key=value ...]   (overrides of every variant, e.g. rollout.cuda_graphs=true)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_args import positive_int
from bench_ppo_step import WORKLOADS, benchmark_config, build, step_record, workload_overrides
from profile_step import phase_table, profile_step, render, top_operators

from refppo import accel
from refppo.accel import logprobs
from refppo.accel.compiled_layers import compile_layers, eager_layers

# Settings the trainer reads at every step (the others are fixed when it is built).
PER_STEP = (
    "micro_batch_size_per_gpu",
    "max_token_len_per_gpu",
    "use_dynamic_bsz",
    "actor.use_torch_compile",
    "model.use_fused_kernels",
    "model.compile_layers",
    "algorithm.rollout_correction.bypass_mode",
)


def parse_variant(text: str) -> tuple[str, list[str], int | None]:
    """``NAME=k=v k=v chunk_elements=N`` -> (name, overrides, chunk elements or None)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=overrides, got {text!r}")
    overrides, chunk = [], None
    for item in rest.split():
        key, _, value = item.partition("=")
        if key == "chunk_elements":
            chunk = positive_int(value)
        elif not any(p in key for p in PER_STEP):
            raise argparse.ArgumentTypeError(
                f"{name}: {key} is fixed when the trainer is built; variants may set {PER_STEP}"
            )
        else:
            overrides.append(item)
    return name, overrides, chunk


def use(trainer, base_overrides: list[str], variant) -> None:
    """Switch ``trainer`` to ``variant`` (name, overrides, chunk elements)."""
    _, overrides, chunk = variant
    trainer.config = benchmark_config(base_overrides + overrides)
    logprobs.CHUNK_ELEMENTS.update(DEFAULT_CHUNK if chunk is None else dict.fromkeys(DEFAULT_CHUNK, chunk))
    trainer.accel = accel.select(trainer.config, trainer.device)
    models = (trainer.actor, trainer.reference, trainer.critic, trainer.reward_model)
    compiled = accel.compiled_models(trainer.config, *models)
    eager_layers(*(m for m in models if not any(m is c for c in compiled)))
    compile_layers(*compiled)


DEFAULT_CHUNK = dict(logprobs.CHUNK_ELEMENTS)


def timed_step(trainer, device: str) -> tuple[float, dict]:
    start = time.perf_counter()
    metrics = trainer.train_step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, metrics


def summarise(runs: dict[str, list[tuple[float, dict]]]) -> dict:
    """Per variant: every timed step, the median, min-max, the median phase times and peak memory."""
    out = {}
    for name, steps in runs.items():
        timed = steps[1:]  # the first is the warm-up
        row = {"warmup_step_s": steps[0][0] if steps else None, "step_s_all": [s for s, _ in timed]}
        if timed:
            row["median_step_s"] = statistics.median(row["step_s_all"])
            row["phases_s"] = {
                k.removeprefix("timing_s/"): statistics.median(m[k] for _, m in timed)
                for k in timed[0][1]
                if k.startswith("timing_s/")
            }
            row["peak_memory_gb"] = max(m["perf/max_memory_allocated_gb"] for _, m in timed)
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument("--variant", action="append", type=parse_variant, required=True, help="NAME=overrides")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, help="a variant to profile for one step at the end")
    parser.add_argument("--record", default=None, help="a variant whose result --record-json gets")
    parser.add_argument("--record-json", default=None)
    parser.add_argument("--commit", default=None, help="the commit measured (recorded)")
    parser.add_argument("overrides", nargs="*", help="every variant's refppo config overrides")
    args = parser.parse_args()
    variants = {v[0]: v for v in args.variant}
    for flag in ("profile", "record"):
        if getattr(args, flag) not in (None, *variants):
            parser.error(f"--{flag} {getattr(args, flag)!r} is not a variant: {sorted(variants)}")
    if bool(args.record) != bool(args.record_json):
        parser.error("--record and --record-json go together")
    base_overrides = workload_overrides(args.workload, extra=tuple(args.overrides))
    for v in variants.values():  # bad overrides, before any work
        try:
            benchmark_config(base_overrides + v[1])
        except ValueError as e:
            parser.error(f"variant {v[0]}: {e}")
    trainer = build(args.workload, args.device, extra=tuple(args.overrides))
    runs: dict[str, list[tuple[float, dict]]] = {name: [] for name in variants}

    def save() -> dict:
        summary = summarise(runs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workload": args.workload, "overrides": args.overrides, "variants": summary}, f, indent=1)
        row = summary.get(args.record, {})
        if row.get("step_s_all"):
            _, overrides, chunk = variants[args.record]
            record = step_record(
                row["step_s_all"], row["phases_s"], args.device, args.commit, args.overrides + overrides, chunk
            )
            with open(args.record_json, "w") as f:
                json.dump(record, f, indent=1)
        return summary

    order = list(variants)
    for r in range(args.rounds + 1):  # round 0: each variant's warm-up
        for name in order if r % 2 == 0 else order[::-1]:
            use(trainer, base_overrides, variants[name])
            seconds, metrics = timed_step(trainer, args.device)
            runs[name].append((seconds, metrics))
            phases = " ".join(
                f"{k.removeprefix('timing_s/')} {v:.2f}" for k, v in metrics.items() if k.startswith("timing_s/")
            )
            print(
                f"{'warm-up' if r == 0 else f'round {r}'} {name}: {seconds:.2f} s | {phases} | "
                f"peak {metrics['perf/max_memory_allocated_gb']:.1f} GB",
                flush=True,
            )
            summary = save()
    for name, row in summary.items():
        print(
            f"{name}: median {row.get('median_step_s', float('nan')):.2f} s over {len(row['step_s_all'])} steps "
            f"(min {min(row['step_s_all'], default=float('nan')):.2f}, max "
            f"{max(row['step_s_all'], default=float('nan')):.2f}), "
            f"peak {row.get('peak_memory_gb', float('nan')):.1f} GB",
            flush=True,
        )
    if args.profile:
        use(trainer, base_overrides, variants[args.profile])
        metrics, events = profile_step(trainer, args.device, warmup=0)
        walls = {k: v for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"}
        table = phase_table(events, walls, args.device)
        print(f"{args.profile} profiled, step {metrics['timing_s/step']:.2f} s (the profiler adds its own overhead)")
        print(render(table, args.device))
        top = top_operators(events, args.device, 15)
        print("top operators by work: " + "; ".join(f"{op} {s:.3f} s ({n} calls)" for op, s, n in top), flush=True)
        if args.json:
            data = json.load(open(args.json))
            data["profile"] = {"variant": args.profile, "step_s": metrics["timing_s/step"], "phases": table, "top": top}
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
