"""Texts to a rollout-layout batch: ``refppo.rollout.prompts.build_batch`` (the batch tokenized in one call,
one tensor per field) vs the same batch built a text and a row at a time, side by side in one run.

SFT and the reward model build one such batch every step (64 demonstrations; 2 x 64 texts of
comparison pairs), and on a tiny model the step's arithmetic is only tens of milliseconds.
Usage: python benchmarks/bench_build_batch.py [--rows 128] [--repeats 21]
"""

import argparse
import statistics
import time

import torch

from refppo.rollout.prompts import build_batch, sequence_batch
from refppo.tasks import preference
from refppo.tasks.tokenizer import build_tokenizer


def build_batch_per_text(tokenizer, prompts, responses):
    """The baseline: one tokenizer call per text and one tensor copy per row."""
    prompt_lists = [tokenizer(p)["input_ids"] for p in prompts]
    response_lists = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    fields = []
    for lists, left in ((prompt_lists, True), (response_lists, False)):
        width = max(map(len, lists))
        ids = torch.full((len(lists), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(lists), width), dtype=torch.long)
        for i, seq in enumerate(lists):
            cols = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[i, cols] = torch.as_tensor(seq, dtype=torch.long)
            mask[i, cols] = 1
        fields += [ids, mask]
    return sequence_batch(*fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="texts per batch (the reward model's 2 x 64)")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    prompts, chosen, rejected = zip(*preference.make_comparisons(args.rows, seed=0))
    responses = [*chosen, *rejected][: args.rows]
    times, batches = {"per text": [], "build_batch": []}, {}
    for _ in range(args.repeats):  # alternating, so a busy moment slows both
        for name, fn in (("per text", build_batch_per_text), ("build_batch", build_batch)):
            start = time.perf_counter()
            batches[name] = fn(tok, prompts, responses)
            times[name].append(time.perf_counter() - start)
    for key in batches["per text"]:
        assert torch.equal(batches["per text"][key], batches["build_batch"][key]), key
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    spread = {name: (min(t) * 1e3, max(t) * 1e3) for name, t in times.items()}
    for name in times:
        print(f"{name:12s} {med[name]:7.2f} ms (min {spread[name][0]:.2f}, max {spread[name][1]:.2f})")
    print(f"{args.rows} rows, equal batches; speed-up {med['per text'] / med['build_batch']:.1f}x")


if __name__ == "__main__":
    main()
