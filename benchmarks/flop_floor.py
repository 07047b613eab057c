"""The arithmetic floor of a PPO step: the least time any code doing a step's matrix products
could take on this machine, beside the step's measured time.

For a workload of ``bench_ppo_step.py`` and an implementation (refppo or TRL), one step after the
warm-up step is recorded: every call of a matrix product or attention op (the ops torch's
``FlopCounterMode`` counts, and on a CPU its flash-attention kernels) with its arguments'
shapes, strides and dtypes. Each distinct call is then replayed alone on random tensors of the
same layout, and the floor is the sum over the step's calls of their replayed times: the step
with nothing but its products, each at the speed this machine gives it in isolation. The step's
own time is the median of the steps after the recorded one, in the same process.

So ``floor_s / step_s`` is the share of a step that its arithmetic must take, and a goal of
``k`` x another implementation's speed is out of reach for any code doing this step's products
when ``floor_s`` exceeds the other's step time / k. ``--replay-dtype bfloat16`` also replays the
matrix products in bf16: whether running them so could lower the floor on this machine.

Usage: python benchmarks/flop_floor.py [--workloads W1,W2] [--impls refppo,trl] [--steps 3]
       [--threads N] [--device cpu|cuda] [--json out.json] [--replay-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
from bench_gae import timed  # timed(fn, device, repeats) -> (median seconds, result)
from bench_ppo_step import checked_choices, time_refppo, time_trl
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
# Scaled-dot-product attention ops, forward (query first) and backward (gradient, then query).
# A CPU's flash kernels are not in torch's flop registry; the others are, but before torch 2.13 its
# formulas refuse grouped-query shapes (fewer key/value heads than query heads), which Qwen2.5 has.
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: False,
    aten._scaled_dot_product_flash_attention: False,
    aten._scaled_dot_product_efficient_attention: False,
    aten._scaled_dot_product_cudnn_attention: False,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: True,
    aten._scaled_dot_product_flash_attention_backward: True,
    aten._scaled_dot_product_efficient_attention_backward: True,
    aten._scaled_dot_product_cudnn_attention_backward: True,
}


def attention_flops(func, args) -> int:
    """FLOPs of one attention call, counted as torch's counter counts them (as if unmasked), with
    grouped keys and values counted at the query's head count: the products each query head does.

    Args:
        func: an op of ``ATTENTION``; args: its arguments, (B, H, L, D) query, key and value first
            (after the output gradient for a backward op).
    """
    backward = ATTENTION[func._overloadpacket]
    q, k, v = (args[i].shape for i in range(int(backward), int(backward) + 3))
    k, v = (s[:1] + q[1:2] + s[2:] for s in (k, v))
    return sdpa_backward_flop_count(args[0].shape, q, k, v) if backward else sdpa_flop_count(q, k, v)


def _layout(value):
    """A hashable stand-in for an op argument: a tensor's (shape, stride, dtype, device), else itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    return value


def _is_tensor(layout) -> bool:
    return isinstance(layout, tuple) and layout[:1] == ("tensor",)


def _materialise(layout, dtype=None):
    """Random arguments with a recorded layout (floating tensors normal, others zero); ``dtype``
    replaces the floating tensors' dtype (None: keep the recorded one)."""
    if _is_tensor(layout):
        _, shape, stride, recorded_dtype, device = layout
        dtype = dtype if dtype is not None and recorded_dtype.is_floating_point else recorded_dtype
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        base = torch.empty(size, dtype=dtype, device=device)  # filled first: strides may overlap
        base = base.normal_() if base.is_floating_point() else base.zero_()
        return base.as_strided(shape, stride)
    if isinstance(layout, tuple):
        return tuple(_materialise(v, dtype) for v in layout)
    return layout


class ProductRecorder(TorchDispatchMode):
    """Counts every call of a matrix-product or attention op by its arguments' layout, with its
    FLOPs (attention counted as if unmasked, as torch's counter does)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.flops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in ATTENTION:
            flops = attention_flops(func, args)
        elif func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        else:
            return out
        key = (func, _layout(args), tuple(sorted((k, _layout(v)) for k, v in kwargs.items())))
        self.calls[key] += 1
        self.flops[key] = flops
        return out


def replay_seconds(key, device: str, repeats: int = 5, dtype=None) -> float:
    """Median seconds of one recorded call, replayed alone on random tensors of its layout (its
    floating tensors in ``dtype`` when given)."""
    func, args, kwargs = key
    args, kwargs = _materialise(args, dtype), {k: _materialise(v, dtype) for k, v in kwargs}
    timed(lambda: func(*args, **kwargs), device, 2)  # warm-up
    return timed(lambda: func(*args, **kwargs), device, repeats)[0]


def floor(impl: str, name: str, device: str, steps: int, replay_dtype=None) -> dict:
    """One implementation on one workload: the recorded step's FLOPs and floor, and the median
    of the ``steps`` steps after it; with ``replay_dtype``, also the floor with the matrix
    products replayed in that dtype (attention calls as recorded: their kernels fix some dtypes)."""
    recorder = ProductRecorder()

    def on_step_end(i: int) -> None:  # record step 1, the first after the warm-up
        if i == 0:
            recorder.__enter__()
        elif i == 1:
            recorder.__exit__(None, None, None)

    run = time_refppo if impl == "refppo" else time_trl
    step_s = statistics.median(run(name, device, steps + 1, on_step_end=on_step_end)["step_s_all"][1:])
    with torch.no_grad():
        seconds = {key: replay_seconds(key, device) for key in recorder.calls}
    total = {key: n * seconds[key] for key, n in recorder.calls.items()}
    floor_s = sum(total.values())
    extra = {}
    if replay_dtype is not None:
        with torch.no_grad():  # attention calls keep their recorded times
            cast = sum(
                n
                * (
                    seconds[key]
                    if key[0]._overloadpacket in ATTENTION
                    else replay_seconds(key, device, dtype=replay_dtype)
                )
                for key, n in recorder.calls.items()
            )
        extra = {"replay_dtype": str(replay_dtype), "floor_s_replay_dtype": cast}
    flops = sum(n * recorder.flops[key] for key, n in recorder.calls.items())
    slowest = sorted(total, key=total.get, reverse=True)[:5]
    return {
        "impl": impl,
        "workload": name,
        "device": device,
        "threads": torch.get_num_threads(),
        "gflop_per_step": flops / 1e9,
        "calls": sum(recorder.calls.values()),
        "distinct_calls": len(recorder.calls),
        "floor_s": floor_s,
        "floor_gflop_per_s": flops / 1e9 / floor_s,
        "step_s": step_s,
        "floor_share_of_step": floor_s / step_s,
        "slowest": [
            f"{k[0]} {[a[1] for a in k[1] if _is_tensor(a)]} x{recorder.calls[k]}: {total[k]:.3f} s" for k in slowest
        ],
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--impls", default="refppo,trl", help="refppo, trl or both (trl needs .[bench])")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the recorded one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--replay-dtype",
        default=None,
        choices=["bfloat16", "float16"],
        help="also replay the matrix products in this dtype: the floor if the step ran them so",
    )
    args = parser.parse_args()
    replay_dtype = getattr(torch, args.replay_dtype) if args.replay_dtype else None
    impls, names = checked_choices(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in names:
        for impl in impls:
            r = floor(impl, name, args.device, args.steps, replay_dtype)
            results.append(r)
            print(
                f"{name} {impl}: {r['gflop_per_step']:.1f} GFLOP a step in {r['calls']} calls "
                f"({r['distinct_calls']} distinct); those calls alone {r['floor_s']:.3f} s "
                f"({r['floor_gflop_per_s']:.0f} GFLOP/s); the step {r['step_s']:.3f} s, "
                f"{r['floor_share_of_step']:.0%} of it the floor",
                flush=True,
            )
            if replay_dtype is not None:
                print(
                    f"    the products in {args.replay_dtype}: {r['floor_s_replay_dtype']:.3f} s "
                    f"({r['floor_s'] / r['floor_s_replay_dtype']:.2f}x the recorded dtypes' speed)"
                )
            for line in r["slowest"]:
                print("   ", line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
