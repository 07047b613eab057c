"""One AdamW step, torch's default implementation (a per-tensor loop on a CPU, ``foreach`` on CUDA)
vs the fused kernel (``refppo.optim.adamw``),
alternating, on the parameters of a tiny model: the arithmetic task's actor (the CLI's default
model) and W1's actor from ``bench_ppo_step.py``.

A PPO step of the arithmetic pipeline takes 8 optimiser steps (4 mini-batches x actor and
critic), SFT one per batch; on a tiny model each step's time is mostly the per-tensor loop's
small ops.

Usage: python benchmarks/bench_adamw.py [--repeats 7] [--threads 1] [--device cpu|cuda]
"""

import argparse
import statistics
import time

import torch

from bench_ppo_step import shared_models
from refppo.models import load_causal_lm, tiny_config
from refppo.tasks.tokenizer import build_tokenizer


def time_steps(params, fused: bool, steps: int = 50) -> float:
    """Milliseconds per ``optimizer.step()`` over ``steps`` steps after 3 warm-up steps; ``fused``
    False is torch's default implementation."""
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=fused or None)
    for _ in range(3):
        optimizer.step()
    if params[0].device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if params[0].device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    models = {
        "arithmetic actor": load_causal_lm(tiny_config(tok, hidden_size=128, num_hidden_layers=2), device=args.device),
        "W1 actor": shared_models("W1", args.device)["actor"],
    }
    for name, model in models.items():
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        times = {"default": [], "fused": []}
        for _ in range(args.repeats):
            for kind in times:
                times[kind].append(time_steps(params, fused=kind == "fused"))
        default, fused = statistics.median(times["default"]), statistics.median(times["fused"])
        print(
            f"{name} ({len(params)} tensors, {sum(p.numel() for p in params):,} weights), {args.device}: "
            f"default {default:.2f} ms [{min(times['default']):.2f}-{max(times['default']):.2f}], "
            f"fused {fused:.2f} ms [{min(times['fused']):.2f}-{max(times['fused']):.2f}], {default / fused:.1f}x"
        )


if __name__ == "__main__":
    main()
