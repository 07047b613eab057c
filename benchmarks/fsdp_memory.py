"""What each process holds under FSDP2, 1 process against 2 (or --processes), side by side.

Each run is ``torchrun --nproc_per_node N`` of this script (``--worker``): every process builds the
same causal LM (``--hidden``, ``--layers``, random weights), shards it with
``refppo.distributed.shard``, takes one AdamW step on a micro-batch of ``--rows`` x ``--tokens``,
and reports ``refppo.guards.memory.held_bytes`` (its shards of the weights, gradients and Adam moments),
``refppo.guards.memory.state_bytes(processes=N)``'s arithmetic, the peak of the tensors the step
allocated (``PeakMeter``: activations and the gathered layers) and the process's peak resident
memory (``ru_maxrss``: everything, Python and libraries included). gloo on a CPU, NCCL on CUDA.
Usage: python benchmarks/fsdp_memory.py [--processes 2] [--hidden 512] [--layers 8] [--rows 4]
       [--tokens 128] [--out results/fsdp_memory.json]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    from refppo.distributed import World, shard, start, stop
    from refppo.guards.memory import PeakMeter, held_bytes, state_bytes
    from refppo.rollout.models import load_causal_lm, tiny_config
    from refppo.tasks.tokenizer import build_tokenizer

    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), distributed=True)
    device = start(world, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = tiny_config(
        tokenizer, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8
    )
    config.vocab_size = args.vocab  # a language model's vocabulary, not the arithmetic task's 20 tokens
    model = shard(load_causal_lm(config).to(device), world)
    n = sum(p.numel() for p in model.parameters())  # every process: the whole count (DTensor numel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, args.vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(world.rank))
    with PeakMeter() as meter:
        model(input_ids=ids.to(device)).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    held = held_bytes(model, optimizer)
    record = {
        "rank": world.rank,
        "processes": world.size,
        "params": n,
        "held": held,
        "predicted": state_bytes(n, precision="fp32", processes=world.size),
        "step_peak": meter.peak,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(args.worker).with_suffix(f".{world.rank}.json").write_text(json.dumps(record))
    stop(world)


def launch(args, processes: int, stem: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command += [__file__, "--worker", str(stem), *sys.argv[1:]]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(stem.with_suffix(f".{rank}.json").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: launch(args, p, Path(tmp) / f"run{p}") for p in (1, args.processes)}
    mb = 2**20
    print(f"{runs[1][0]['params'] / 1e6:.1f}M parameters; MiB per process (rank 0)")
    print("processes  weights  gradients  optimizer  state (predicted)  step peak  max RSS")
    for p, ranks in runs.items():
        r = ranks[0]
        state, predicted = sum(r["held"].values()), sum(r["predicted"].values())
        row = [r["held"]["weights"], r["held"]["gradients"], r["held"]["optimizer"]]
        print(
            f"{p:9d}  " + "  ".join(f"{v / mb:8.1f}" for v in row) + f"  {state / mb:7.1f} ({predicted / mb:6.1f})"
            f"  {r['step_peak'] / mb:9.1f}  {r['maxrss'] / mb:7.1f}"
        )
    one, many = (sum(runs[p][0]["held"].values()) for p in (1, args.processes))
    print(f"state held by one of {args.processes} processes / by one process: {many / one:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
