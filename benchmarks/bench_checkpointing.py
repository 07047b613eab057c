"""Activation checkpointing (``model.enable_gradient_checkpointing``) vs none, side by side: one
actor micro-batch's forward + backward, as the update runs it.

Two copies of one workload's actor (``bench_ppo_step.py``'s shapes, random weights), one with
checkpointing; a left-padded micro-batch of ``--rows`` rows x (prompt + response) tokens (one
row padded, so the passes carry a mask as a PPO batch's do). Reports the peak bytes of the
tensors the pass allocates (``refppo.guards.memory.PeakMeter``; the weights excluded) beside the
arithmetic (``refppo.guards.memory.activation_bytes``, ``refppo.accel.checkpointing.checkpointed_activation_bytes``),
and the median time of alternating repeats; asserts that both give the same gradient (bit for bit on a CPU).
Usage: python benchmarks/bench_checkpointing.py [--workload W2|W3|Q] [--rows N] [--device cpu|cuda]
       [--repeats 7] [--threads T]
"""

import argparse
import statistics

import torch
from bench_args import positive_int
from bench_gae import timed  # one run: timed(fn, device, 1) -> (seconds, result)
from bench_ppo_step import WORKLOADS, workload_model

from refppo.accel.checkpointing import checkpointed_activation_bytes, enable_gradient_checkpointing
from refppo.guards.memory import PeakMeter, activation_bytes
from refppo.rollout.forward import response_log_probs
from refppo.rollout.models import load_causal_lm
from refppo.rollout.prompts import sequence_batch


def micro_batch(rows: int, prompt_len: int, response_len: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """Random prompts and responses; the first row's prompt is half padding."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompt_mask[0, : prompt_len // 2] = 0
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (rows, response_len), generator=g)
    batch = sequence_batch(prompts, prompt_mask, responses, torch.ones_like(responses))
    return {k: v.to(device) for k, v in batch.items()}


def forward_backward(model, batch) -> list[torch.Tensor]:
    """The sum of the response log-probs, backpropagated; returns the gradients."""
    model.zero_grad(set_to_none=True)
    log_probs, _ = response_log_probs(model, batch)
    log_probs.sum().backward()
    return [p.grad for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument(
        "--rows", type=positive_int, default=None, help="default: the workload's micro-batch, else its prompts"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    rows = args.rows or w.get("micro", w["prompts"])
    _, config = workload_model(args.workload)
    models = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        models[checkpointed] = load_causal_lm(config, device=args.device).train()
    enable_gradient_checkpointing(models[True])
    batch = micro_batch(rows, w["prompt_len"], w["response_len"], config.vocab_size, args.device)

    peaks, grads = {}, {}
    for checkpointed, model in models.items():
        with PeakMeter() as meter:
            grads[checkpointed] = forward_backward(model, batch)
        peaks[checkpointed] = meter.peak
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for checkpointed, model in models.items():
            times[checkpointed].append(timed(lambda m=model: forward_backward(m, batch), args.device, 1)[0])

    tokens, seq_len = batch["input_ids"].numel(), batch["input_ids"].shape[1]
    print(
        f"{args.workload}: {rows} rows x {seq_len} tokens, {args.device}, {torch.get_num_threads()} threads, median "
        f"of {args.repeats}"
    )
    for checkpointed in (False, True):
        t = times[checkpointed]
        estimate = checkpointed_activation_bytes if checkpointed else activation_bytes
        act = estimate(config, tokens, rows * (w["response_len"] + 1), 4, seq_len)
        arithmetic = f" (float32 activations' arithmetic {act / 2**20:,.0f} MiB)" if args.device == "cpu" else ""
        print(
            f"{'checkpointed' if checkpointed else 'plain':12s}: peak {peaks[checkpointed] / 2**20:,.0f} "
            f"MiB{arithmetic}; "
            f"{statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f})"
        )
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"checkpointing: {peaks[True] / peaks[False]:.0%} of the peak, {ratio:.2f}x the time")
    flat = {k: torch.cat([g.flatten().float() for g in v]) for k, v in grads.items()}
    if args.device == "cpu":
        assert torch.equal(flat[False], flat[True]), "the gradients differ"
    else:  # bf16 autocast: the recomputation may pick other kernels
        relative = float((flat[True] - flat[False]).norm() / flat[False].norm())
        assert relative < 1e-2, relative


if __name__ == "__main__":
    main()
