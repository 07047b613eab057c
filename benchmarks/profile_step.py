"""Where a PPO step's time goes: one refppo step under ``torch.profiler``, phase by phase, split
into kinds of work (matrix products, attention, softmax and sampling, copies, the optimiser, ...).

The trainer runs each phase of a step (``timing_s/gen``, ``/ref``, ``/update_actor``, ...) inside
a profiler range of the same name; an operator belongs to the phase during which it started, on
any thread (the autograd engine runs the backward pass on a thread of its own on a GPU). The
work of an operator is its own time without its children's: on a CPU its CPU time, on a GPU the
time of the kernels it launched. ``wall`` is the phase's ``timing_s``; ``busy`` the sum of the
work; on a GPU ``wall - busy`` is time the device sat idle, waiting for Python and kernel
launches (what CUDA graphs and compilation remove), on a CPU time spent outside operators
(Python, the tokenizer).

Usage: python benchmarks/profile_step.py [--workloads W2] [--device cpu|cuda] [--warmup 1]
       [--threads N] [--top 15] [--json out.json] [--chunk-elements N] [key=value ...]
       (refppo config overrides; --chunk-elements: the log-softmax's blocks, rows x vocab elements)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from bench_args import positive_int
from bench_ppo_step import WORKLOADS, build, set_chunk_elements
from torch.profiler import ProfilerActivity, profile

# (kind of work, aten operator names), the first that names an operator wins
KINDS = (
    ("matrix products", {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "_scaled_mm"}),
    (
        "attention",
        {
            "scaled_dot_product_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_efficient_attention_forward",
            "_efficient_attention_backward",
            "_flash_attention_forward",
            "_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
        },
    ),
    (
        "softmax and sampling",
        {
            "logsumexp",
            "log_softmax",
            "_log_softmax",
            "softmax",
            "_softmax",
            "_softmax_backward_data",
            "_log_softmax_backward_data",
            "gather",
            "scatter_add_",
            "scatter_add",
            "multinomial",
            "topk",
            "sort",
            "cumsum",
            "argmax",
        },
    ),
    (
        "copies and casts",
        {
            "copy_",
            "_to_copy",
            "clone",
            "cat",
            "stack",
            "index",
            "index_select",
            "repeat_interleave",
            "index_put_",
            "_index_put_impl_",
            "masked_select",
            "contiguous",
            "to",
        },
    ),
)
COLUMNS = (
    "matrix products",
    "attention",
    "softmax and sampling",
    "copies and casts",
    "elementwise and other",
    "optimizer",
    "compiled code",
    "autograd engine",
)


def kind(name: str, in_optimizer: bool) -> str | None:
    """The kind of work of one profiled event, or None for a range that only groups others.

    Args:
        name: the event's name (``aten::mm``, ``AddmmBackward0``, ``Torch-Compiled Region: 0/1``, ...).
        in_optimizer: the event runs inside an optimiser's step or zero_grad (its profiler range),
            or it is gradient clipping's ``_foreach`` arithmetic.
    """
    if name.startswith(
        ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "cpp_fused", "triton_")
    ):
        return "compiled code"
    if name.startswith("autograd::engine") or name.endswith(("Backward0", "Backward1")):
        return "autograd engine"
    op = name.removeprefix("aten::")
    if in_optimizer or op.startswith("_foreach"):
        return "optimizer"
    if not name.startswith("aten::"):
        return None
    return next((k for k, names in KINDS if op in names), "elementwise and other")


def operators(events, device: str):
    """The profile's operators and the seconds of their own work: CPU time on a CPU, the time of
    the kernels they launched on a GPU. Ranges (``record_function``) hold no work of their own, and
    a kernel is counted with the operator that launched it, so neither is listed.

    Yields:
        (event, seconds).
    """
    for e in events:
        if not e.is_user_annotation and e.device_type == torch.autograd.DeviceType.CPU:
            yield e, (e.self_device_time_total if device == "cuda" else e.self_cpu_time_total) / 1e6


def phase_table(events, walls: dict[str, float], device: str) -> dict[str, dict[str, float]]:
    """Each phase's work by kind, in seconds, from a profile's events.

    Args:
        events: ``prof.events()`` of one step; the phases are its ``timing_s/<name>`` ranges.
        walls: ``timing_s/<name>`` -> the phase's wall seconds (the trainer's metrics).
        device: "cpu" (an event's work is its own CPU time) or "cuda" (its kernels' time).

    Returns:
        ``timing_s/<name>`` -> {"wall", "busy", one key per kind in ``COLUMNS``, "kernels"}.
        ``busy`` is the sum of the kinds; work outside every phase is not counted.
    """
    phases = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in events if e.name in walls and e.is_user_annotation),
        key=lambda p: p[0],
    )
    optimizer_spans = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("Optimizer.")]
    table = {
        name: {"wall": walls[name], "busy": 0.0, **dict.fromkeys(COLUMNS, 0.0), "kernels": 0} for _, _, name in phases
    }
    for e, work in operators(events, device):
        start = e.time_range.start
        phase = next((name for a, b, name in phases if a <= start <= b), None)
        if phase is None:
            continue
        in_optimizer = any(a <= start <= b for a, b in optimizer_spans)
        k = kind(e.name, in_optimizer)
        if k is None:
            continue
        row = table[phase]
        row[k] += work
        row["busy"] += work
        row["kernels"] += len(e.kernels)
    return table


def top_operators(events, device: str, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` operators with the most work over the whole profile: (name, seconds, calls)."""
    work, calls = defaultdict(float), defaultdict(int)
    for e, seconds in operators(events, device):
        if kind(e.name, False) is None:  # not an operator: a range, or CUDA's "Command Buffer Full" stall
            continue
        work[e.name] += seconds
        calls[e.name] += 1
    return [(name, work[name], calls[name]) for name in sorted(work, key=work.get, reverse=True)[:n]]


def profile_step(trainer, device: str, warmup: int = 1):
    """``warmup`` plain steps (compilation, caches), then one profiled step.

    Returns:
        (the profiled step's metrics, its ``prof.events()``).
    """
    for _ in range(warmup):
        trainer.train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        metrics = trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
    return metrics, prof.events()


def render(table: dict[str, dict[str, float]], device: str) -> str:
    """The phase table as text: seconds of each kind of work, and busy as a share of wall."""
    short = {
        "matrix products": "matmul",
        "attention": "attn",
        "softmax and sampling": "softmax",
        "copies and casts": "copy",
        "elementwise and other": "other",
        "optimizer": "optim",
        "compiled code": "compiled",
        "autograd engine": "autograd",
    }
    busy = "GPU busy" if device == "cuda" else "in ops"
    head = f"{'phase':<22}{'wall s':>8}{busy:>10}" + "".join(f"{short[k]:>10}" for k in COLUMNS) + f"{'kernels':>9}"
    lines = [head]
    for name, row in table.items():
        share = row["busy"] / row["wall"] if row["wall"] else 0.0
        cells = "".join(f"{row[k]:>10.3f}" for k in COLUMNS)
        lines.append(f"{name.removeprefix('timing_s/'):<22}{row['wall']:>8.3f}{share:>10.0%}{cells}{row['kernels']:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=1, help="plain steps before the profiled one")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--top", type=int, default=15, help="operators listed by their work")
    parser.add_argument("--json", default=None, help="also write the tables here")
    parser.add_argument(
        "--chunk-elements", type=positive_int, default=None, help="refppo's log-softmax blocks (rows x vocab elements)"
    )
    parser.add_argument("overrides", nargs="*", help="refppo config overrides, e.g. rollout.cuda_graphs=true")
    args = parser.parse_args()
    names = args.workloads.split(",")
    if unknown := set(names) - set(WORKLOADS):
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_chunk_elements(args.chunk_elements)
    out = {}
    for name in names:
        torch.manual_seed(0)
        trainer = build(name, args.device, extra=tuple(args.overrides))
        metrics, events = profile_step(trainer, args.device, args.warmup)
        walls = {k: v for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"}
        table = phase_table(events, walls, args.device)
        top = top_operators(events, args.device, args.top)
        print(
            f"{name} on {args.device}, step {metrics['timing_s/step']:.3f} s (profiled; the profiler adds its own "
            "overhead)"
        )
        print(render(table, args.device))
        print("top operators by work: " + "; ".join(f"{op} {s:.3f} s ({n} calls)" for op, s, n in top), flush=True)
        out[name] = {"step_s": metrics["timing_s/step"], "phases": table, "top": top}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
