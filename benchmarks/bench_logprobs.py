"""Chunked vs naive log-probs from logits, side by side in one run: peak extra memory and time.

Goal (issue 2): at 4096 tokens x 32000 vocab, the chunked version's peak extra memory is
<= 25% of the naive one's, at equal speed or better.

For forward+backward the gradient itself (the size of the logits, which every implementation
must return) is subtracted: the table shows the memory on top of it.
Each (variant, pass) is measured in a fresh subprocess so that peak memory is its own:
on the CPU the peak resident set size above the level reached after allocating the inputs,
on CUDA torch.cuda.max_memory_allocated above the same level.
Usage: python benchmarks/bench_logprobs.py [--device cpu|cuda] [--dtype float32|bfloat16]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from refppo.functional import logprobs_from_logits


def naive(logits, labels):
    """The usual one-liner: a full float32 log-softmax, then a gather."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def chunked(logits, labels):
    return logprobs_from_logits(logits, labels)


def peak_bytes(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(variant, backward, device, dtype, tokens, vocab, repeats):
    fn = {"naive": naive, "chunked": chunked}[variant]
    gen = torch.Generator().manual_seed(0)
    # Filled in place: a temporary copy here would raise the baseline peak and hide the cost.
    logits = torch.empty(tokens, vocab, device=device, dtype=getattr(torch, dtype)).normal_(0, 2)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    logits.requires_grad_(backward)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = peak_bytes(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(logits, labels)
        if backward:
            out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
        logits.grad = None
    # Backward must produce a gradient the size of the logits; report what comes on top of it.
    grad_mib = logits.numel() * logits.element_size() / 2**20 if backward else 0.0
    return {"extra_mib": (peak_bytes(device) - base) / 2**20 - grad_mib, "ms": statistics.median(times) * 1e3}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "BACKWARD"))
    a = p.parse_args()
    if a.child:
        r = measure(a.child[0], a.child[1] == "1", a.device, a.dtype, a.tokens, a.vocab, a.repeats)
        print(json.dumps(r))
        return
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen).to(a.device)
    labels = torch.randint(0, 1000, (64,), generator=gen).to(a.device)
    err = (chunked(logits, labels) - naive(logits, labels)).abs().max().item()
    print(f"device={a.device} dtype={a.dtype} tokens={a.tokens} vocab={a.vocab} "
          f"threads={torch.get_num_threads()}  max |chunked - naive| = {err:.1e}")
    print(f"{'pass':<18}{'naive MiB':>11}{'chunked MiB':>13}{'mem ratio':>11}{'naive ms':>10}{'chunked ms':>12}{'speed-up':>10}")
    for backward in (False, True):
        res = {}
        for variant in ("naive", "chunked"):
            cmd = [sys.executable, __file__, "--device", a.device, "--dtype", a.dtype, "--tokens", str(a.tokens),
                   "--vocab", str(a.vocab), "--repeats", str(a.repeats), "--child", variant, str(int(backward))]
            res[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        n, c = res["naive"], res["chunked"]
        name = "fwd+bwd (-grad)" if backward else "forward"
        print(f"{name:<18}{n['extra_mib']:>11.0f}{c['extra_mib']:>13.0f}{c['extra_mib'] / n['extra_mib']:>10.0%}"
              f"{n['ms']:>10.0f}{c['ms']:>12.0f}{n['ms'] / c['ms']:>9.2f}x")


if __name__ == "__main__":
    main()
