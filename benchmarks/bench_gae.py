"""GAE without a loop over tokens (``refppo.accel.gae.packed_gae_advantage_return``) vs the plain
reverse loop (``refppo.advantages.compute_gae_advantage_return``, verl's), side by side in one run.

Goal (issue 2): at batch 64 x length 1024 on a 2-core CPU, >= 20x faster and equal to 1e-5.
Usage: python benchmarks/bench_gae.py [--device cpu|cuda] [--batch 64] [--length 1024]
"""

import argparse
import statistics
import time

import torch

from refppo.accel.gae import packed_gae_advantage_return
from refppo.advantages import compute_gae_advantage_return


def timed(fn, device, repeats):
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    b, n = a.batch, a.length
    rewards = torch.randn(b, n, generator=gen).to(a.device)
    values = torch.randn(b, n, generator=gen).to(a.device)
    lengths = torch.randint(n // 4, n + 1, (b,), generator=gen)
    mask = (torch.arange(n)[None] < lengths[:, None]).float().to(a.device)
    args = (rewards, values, mask, 1.0, 0.95)
    compute_gae_advantage_return(*args), packed_gae_advantage_return(*args)  # warm-up
    t_loop, (adv_l, ret_l) = timed(lambda: compute_gae_advantage_return(*args), a.device, a.repeats)
    t_vec, (adv_v, ret_v) = timed(lambda: packed_gae_advantage_return(*args), a.device, a.repeats)
    err = max((adv_v - adv_l).abs().max().item(), (ret_v - ret_l).abs().max().item())
    print(f"device={a.device} threads={torch.get_num_threads()} batch={b} length={n} (float32, ragged masks)")
    print(f"reverse loop: {t_loop * 1e3:9.2f} ms (median of {a.repeats})")
    print(f"packed      : {t_vec * 1e3:9.2f} ms")
    print(f"speed-up    : {t_loop / t_vec:9.1f}x   max |diff| = {err:.2e}   goal: >= 20x, <= 1e-5")


if __name__ == "__main__":
    main()
