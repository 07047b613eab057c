"""Micro-batches of a fixed row count vs of a token budget (``use_dynamic_bsz``), side by side.

A batch of responses of very different lengths, as a real rollout has, split two ways with the
same bound on the tokens a forward pass holds (so the same activation memory):

- rows: ``micro`` consecutive rows per pass, each pass as wide as the whole batch (refppo's
  ``ppo_micro_batch_size_per_gpu``);
- tokens: rows sorted by length and grouped under a budget of ``micro`` x the batch's width,
  each group cut to its own longest prompt and response (``use_dynamic_bsz``,
  ``ppo_max_token_len_per_gpu``).

Times one actor forward + backward over the whole batch (the update's work per mini-batch) and
one no-grad log-prob pass, alternating the two splits, median of the repeats; reports the
tokens each computes (padding included) and the largest micro-batch, and checks that both give
the same log-probs and gradient.
Usage: python benchmarks/bench_dynamic_bsz.py [--device cpu|cuda] [--rows 64] [--micro 8] [--repeats 5]
"""

import argparse
import statistics

import torch
from bench_gae import timed  # one run: timed(fn, device, 1) -> (seconds, result)
from transformers import LlamaConfig, LlamaForCausalLM

from refppo.accel.token_budget import TokenBudgetPasses
from refppo.rollout.forward import ForwardPasses, response_log_probs
from refppo.rollout.prompts import sequence_batch


def ragged_batch(rows: int, vocab: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Prompts of 16-64 tokens (left-padded) and responses of 8-256 (right-padded), uniform."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(16, 65, (rows,), generator=g)
    r_len = torch.randint(8, 257, (rows,), generator=g)
    width_p, width_r = int(p_len.max()), int(r_len.max())
    prompt_mask = (torch.arange(width_p) >= width_p - p_len[:, None]).long()
    response_mask = (torch.arange(width_r) < r_len[:, None]).long()
    prompts = torch.randint(3, vocab, (rows, width_p), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (rows, width_r), generator=g) * response_mask
    batch = sequence_batch(prompts, prompt_mask, responses, response_mask)
    return {k: v.to(device) for k, v in batch.items()}


def forward_backward(model, batch, passes, micro):
    """Sum of the response log-probs over every micro-batch, backpropagated; (tokens computed, largest micro-batch)."""
    model.zero_grad(set_to_none=True)
    computed, largest = 0, 0
    for _, mb in passes.micro_batches(batch, micro):
        log_probs, _ = response_log_probs(model, mb)
        log_probs.sum().backward()
        size = mb["input_ids"].numel()
        computed, largest = computed + size, max(largest, size)
    return computed, largest


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).to(args.device)
    batch = ragged_batch(args.rows, config.vocab_size, args.device)
    budget = args.micro * batch["input_ids"].shape[1]
    splits = {"rows": (ForwardPasses(), args.micro), "tokens": (TokenBudgetPasses(max_tokens=budget), None)}
    valid = int(batch["attention_mask"].sum())
    print(
        f"{args.rows} rows, width {batch['input_ids'].shape[1]}, {valid} valid tokens; micro-batch {args.micro} rows "
        f"or {budget} tokens; {args.device}"
    )

    results = {name: {"fwd_bwd": [], "log_probs": []} for name in splits}
    grads, log_probs = {}, {}
    for _ in range(args.repeats):
        for name, (passes, micro) in splits.items():
            seconds, (computed, largest) = timed(
                lambda p=passes, n=micro: forward_backward(model, batch, p, n), args.device, 1
            )
            results[name]["fwd_bwd"].append(seconds)
            results[name]["tokens"], results[name]["largest"] = computed, largest
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
            seconds, log_probs[name] = timed(
                lambda p=passes, n=micro: p.compute_log_probs(model, batch, 1.0, n), args.device, 1
            )
            results[name]["log_probs"].append(seconds)
    scale = grads["rows"].abs().max()
    grad_diff = float((grads["rows"] - grads["tokens"]).abs().max() / scale)
    lp_diff = float((log_probs["rows"] - log_probs["tokens"]).abs().max())
    for name, r in results.items():
        fb, lp = statistics.median(r["fwd_bwd"]), statistics.median(r["log_probs"])
        print(
            f"{name:6s}: tokens computed {r['tokens']:7d} ({r['tokens'] / valid:.2f}x the valid ones), largest "
            "micro-batch "
            f"{r['largest']:6d}; forward+backward {fb:.3f} s ({min(r['fwd_bwd']):.3f}-{max(r['fwd_bwd']):.3f}), "
            f"log-probs {lp:.3f} s ({min(r['log_probs']):.3f}-{max(r['log_probs']):.3f})"
        )
    ratio = lambda key: statistics.median(results["rows"][key]) / statistics.median(results["tokens"][key])  # noqa: E731
    print(
        f"speed-up of the token budget: forward+backward {ratio('fwd_bwd'):.2f}x, log-probs {ratio('log_probs'):.2f}x; "
        f"max relative gradient difference {grad_diff:.1e}, max log-prob difference {lp_diff:.1e}"
    )
    # On CUDA the passes autocast to bf16, whose rounding differs between micro-batch widths.
    tolerance = 1e-3 if args.device == "cpu" else 5e-2
    assert results["tokens"]["largest"] <= budget and grad_diff < tolerance and lp_diff < tolerance, tolerance


if __name__ == "__main__":
    main()
