"""Chunked vs naive log-probs from logits, side by side in one run: peak extra memory and time.

Goal (issue 2): at 4096 tokens x 32000 vocab, the chunked version's peak extra memory is
<= 25% of the naive one's, at equal speed or better.

With ``--hidden H`` the inputs are final hidden states (tokens, H) and an LM head (vocab, H)
instead, and the two variants are refppo's two paths (issue 15, ``model.use_fused_kernels``):
``head`` = the head's logits, then the chunked log-softmax; ``fused`` = ``fused_logprobs``,
which never holds the logits.

``--pair A,B`` picks the two variants: also ``compiled`` (the chunked log-softmax with
``compiled=True``, ``actor.use_torch_compile``) and ``fused_compiled``. A compiled variant is
compiled on a small input before the measured inputs exist, and the peak is reset after it, so
neither the compilation's time nor the compiler's own memory is counted.

For forward+backward the gradient itself (the size of the logits, which every implementation
must return) is subtracted: the table shows the memory on top of it.
Each (variant, pass) is measured in a fresh subprocess so that peak memory is its own:
on the CPU the peak resident set size above the level reached after allocating the inputs,
on CUDA torch.cuda.max_memory_allocated above the same level.
Usage: python benchmarks/bench_logprobs.py [--device cpu|cuda] [--dtype float32|bfloat16]
       [--tokens N] [--vocab V] [--hidden H] [--chunk-elements N] [--pair A,B]
"""

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import torch
from bench_args import positive_int

from refppo.accel.logprobs import chunked_logprobs, fused_logprobs


def naive(logits, labels):
    """The usual one-liner: a full float32 log-softmax, then a gather."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


CHUNK_ELEMENTS = None  # --chunk-elements: the chunked variants' chunk size; None: refppo's default


def rows_per_chunk(vocab):
    return None if CHUNK_ELEMENTS is None else max(1, CHUNK_ELEMENTS // vocab)


def chunked(logits, labels):
    return chunked_logprobs(logits, labels, chunk_size=rows_per_chunk(logits.shape[-1]))[0]


def head(hidden, weight, labels):
    """The LM head, then the chunked log-softmax: refppo without model.use_fused_kernels."""
    return chunked_logprobs(hidden @ weight.T, labels, chunk_size=rows_per_chunk(weight.shape[0]))[0]


def fused(hidden, weight, labels):
    return fused_logprobs(hidden, weight, labels, chunk_size=rows_per_chunk(weight.shape[0]))[0]


def compiled(logits, labels):
    return chunked_logprobs(logits, labels, chunk_size=rows_per_chunk(logits.shape[-1]), compiled=True)[0]


def fused_compiled(hidden, weight, labels):
    return fused_logprobs(hidden, weight, labels, chunk_size=rows_per_chunk(weight.shape[0]), compiled=True)[0]


VARIANTS = {
    "naive": naive,
    "chunked": chunked,
    "head": head,
    "fused": fused,
    "compiled": compiled,
    "fused_compiled": fused_compiled,
}
FROM_HIDDEN = {"head", "fused", "fused_compiled"}


def peak_bytes(device):
    """CUDA: the peak allocated; CPU: the process's peak resident set (VmHWM)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def reset_peak(device):
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    # Memory freed since (the compiler's) stays resident until handed back, and would absorb the
    # measured variant's allocations unseen; then the peak resident set falls to the current one.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def draw_inputs(tokens, vocab, hidden, device, dtype):
    """[(tokens, vocab) logits], or [(tokens, hidden) hidden states, (vocab, hidden) head] when
    ``hidden`` > 0, with logits of a few nats' spread (wider ones fill the softmax with denormals,
    slow on a CPU). Filled in place: a temporary copy would raise a memory baseline taken after."""
    shapes = [(tokens, hidden), (vocab, hidden)] if hidden else [(tokens, vocab)]
    return [
        torch.empty(shape, device=device, dtype=getattr(torch, dtype)).normal_(0, hidden**-0.25 if hidden else 2.0)
        for shape in shapes
    ]


def run_once(fn, inputs, labels, backward):
    out = fn(*inputs, labels)
    if backward:
        out.sum().backward()
    return out


def measure(variant, backward, device, dtype, tokens, vocab, hidden, repeats):
    fn = VARIANTS[variant]
    if variant.endswith("compiled"):  # compile first, on an input too small to matter
        small = draw_inputs(min(tokens, 64), vocab, hidden, device, dtype)
        for x in small:
            x.requires_grad_(backward)
        run_once(fn, small, torch.randint(0, vocab, (small[0].shape[0],), device=device), backward)
        del small
        reset_peak(device)
    inputs = draw_inputs(tokens, vocab, hidden, device, dtype)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    for x in inputs:
        x.requires_grad_(backward)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = peak_bytes(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run_once(fn, inputs, labels, backward)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
        for x in inputs:
            x.grad = None
    # Backward must produce gradients the size of the inputs; report what comes on top of them.
    grad_mib = sum(x.numel() * x.element_size() for x in inputs) / 2**20 if backward else 0.0
    return {"extra_mib": (peak_bytes(device) - base) / 2**20 - grad_mib, "ms": statistics.median(times) * 1e3}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=0, help="> 0: from hidden states of this width through an LM head")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-elements", type=positive_int, help="rows x vocab per chunk (default: refppo's)")
    p.add_argument(
        "--pair",
        help="the two variants compared, e.g. chunked,compiled (default: naive,chunked; head,fused with --hidden)",
    )
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "BACKWARD"))
    a = p.parse_args()
    global CHUNK_ELEMENTS
    CHUNK_ELEMENTS = a.chunk_elements
    if a.child:
        r = measure(a.child[0], a.child[1] == "1", a.device, a.dtype, a.tokens, a.vocab, a.hidden, a.repeats)
        print(json.dumps(r))
        return
    gen = torch.Generator().manual_seed(1)
    names = tuple(a.pair.split(",")) if a.pair else ("head", "fused") if a.hidden else ("naive", "chunked")
    if len(names) != 2 or not set(names) <= set(VARIANTS) or len({n in FROM_HIDDEN for n in names}) != 1:
        p.error(
            f"--pair takes two of {', '.join(VARIANTS)}, both from logits or both from hidden states "
            f"({', '.join(sorted(FROM_HIDDEN))})"
        )
    if (names[0] in FROM_HIDDEN) != bool(a.hidden):
        p.error("variants from hidden states need --hidden H > 0, the others --hidden 0")
    shapes = [(64, 32), (1000, 32)] if a.hidden else [(64, 1000)]  # hidden states and head, or logits
    small = [torch.randn(shape, generator=gen).to(a.device) for shape in shapes]
    labels = torch.randint(0, 1000, (64,), generator=gen).to(a.device)
    err = (VARIANTS[names[1]](*small, labels) - VARIANTS[names[0]](*small, labels)).abs().max().item()
    print(
        f"device={a.device} dtype={a.dtype} tokens={a.tokens} vocab={a.vocab} hidden={a.hidden} "
        f"chunk_elements={a.chunk_elements or 'default'} threads={torch.get_num_threads()}  max |{names[1]} - "
        f"{names[0]}| = {err:.1e}"
    )
    print(
        f"{'pass':<18}{names[0] + ' MiB':>11}{names[1] + ' MiB':>13}{'mem ratio':>11}"
        f"{names[0] + ' ms':>10}{names[1] + ' ms':>12}{'speed-up':>10}"
    )
    for backward in (False, True):
        res = {}
        for variant in names:
            cmd = [
                sys.executable,
                __file__,
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                "--tokens",
                str(a.tokens),
                "--vocab",
                str(a.vocab),
                "--hidden",
                str(a.hidden),
                "--repeats",
                str(a.repeats),
                "--child",
                variant,
                str(int(backward)),
                *(["--chunk-elements", str(a.chunk_elements)] if a.chunk_elements else []),
            ]
            res[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        n, c = res[names[0]], res[names[1]]
        name = "fwd+bwd (-grad)" if backward else "forward"
        print(
            f"{name:<18}{n['extra_mib']:>11.0f}{c['extra_mib']:>13.0f}{c['extra_mib'] / n['extra_mib']:>10.0%}"
            f"{n['ms']:>10.0f}{c['ms']:>12.0f}{n['ms'] / c['ms']:>9.2f}x"
        )


if __name__ == "__main__":
    main()
