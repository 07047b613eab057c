"""The actor's log-prob pass, forward + backward, with the entropy logged: in the loss with
coefficient 0 (what refppo's actor loss did before) vs logged only (what it does now, as verl
does), side by side in one run. Both give the same gradient, bit for bit (asserted).

With ``entropy_coeff = 0`` the entropy term adds nothing, but while it is in the loss autograd
hands the chunked log-softmax a zero gradient for it, and the backward pass computes the
entropy's gradient (p * (z - E_p[z]), a few passes over every chunk of logits) to multiply it by
zero. Logged only, the backward pass gets None and skips that work.

Usage: python benchmarks/bench_entropy_grad.py [--device cpu|cuda] [--dtype float32|bfloat16]
       [--tokens N] [--vocab V] [--hidden H (> 0: from hidden states, model.use_fused_kernels)]
       [--repeats R]
"""

import argparse
import statistics

import torch
from bench_gae import timed  # timed(fn, device, repeats) -> (median seconds, result)
from bench_logprobs import draw_inputs

from refppo.accel.logprobs import chunked_logprobs, fused_logprobs


def step(inputs, labels, weights, entropy_in_loss: bool, hidden: bool):
    """One forward + backward of sum(w * log p) (+ 0 * sum(entropy)); returns the input gradients."""
    x = [t.detach().requires_grad_() for t in inputs]
    fn = fused_logprobs if hidden else chunked_logprobs
    logp, ent = fn(*x, labels, calculate_entropy=True)
    loss = (weights * logp).sum()
    if entropy_in_loss:
        loss = loss - 0.0 * ent.sum()
    loss.backward()
    return [t.grad for t in x]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    torch.manual_seed(0)
    inputs = draw_inputs(a.tokens, a.vocab, a.hidden, a.device, a.dtype)
    labels = torch.randint(0, a.vocab, (a.tokens,), device=a.device)
    weights = torch.randn(a.tokens, device=a.device)
    hidden = a.hidden > 0
    first = [step(inputs, labels, weights, flag, hidden) for flag in (True, False)]
    assert all(torch.equal(g0, g1) for g0, g1 in zip(*first)), "the two variants' gradients differ"
    times = {True: [], False: []}
    for _ in range(a.repeats):  # alternating, one call at a time
        for flag in (True, False):
            times[flag].append(timed(lambda f=flag: step(inputs, labels, weights, f, hidden), a.device, 1)[0])
    before, after = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"device={a.device} dtype={a.dtype} tokens={a.tokens} vocab={a.vocab} hidden={a.hidden} "
        f"threads={torch.get_num_threads()} median of {a.repeats}, gradients equal"
    )
    print(
        f"entropy in the loss x 0: {before * 1e3:.0f} ms   logged only: {after * 1e3:.0f} ms   "
        f"speed-up {before / after:.2f}x"
    )


if __name__ == "__main__":
    main()
