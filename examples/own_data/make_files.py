"""Write the three small files of the README's "your own data" section: which of two digits is
larger, as a user's data would hold it, one layout each.

    python examples/own_data/make_files.py [--out examples/own_data]

- ``sft.jsonl``: 80 chats (TRL's ``messages`` layout; 10 of them two questions long) from a
  sloppy teacher who gives the smaller digit one time in four, each with verl's
  ``reward_model.ground_truth``, the right answer to its last question, for ``refppo sft``;
- ``pairs.jsonl``: 60 comparisons in UltraFeedback-binarized's layout (a ``prompt`` text and the
  ``chosen`` and ``rejected`` chats: the larger digit against the smaller), for ``refppo rm``;
- ``prompts.jsonl``: the 90 questions in verl's data schema (``data_source``, ``prompt`` as a chat,
  ``ability``, ``reward_model``, ``extra_info``), for ``refppo ppo``.

The same seed writes the same files; the repository holds them as written.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROBLEMS = [(a, b) for a in range(10) for b in range(10) if a != b]
TEACHER_ERROR = 0.25  # the share of the teacher's answers that are the smaller digit


def question(a: int, b: int) -> str:
    return f"max {a} {b}="


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def sft_records(rng: random.Random) -> list[dict]:
    """80 chats over 90 questions: 70 of one question, 10 of two."""
    problems = rng.sample(PROBLEMS, 90)
    records = []
    for i in range(80):
        asked = problems[i : i + 1] if i < 70 else problems[70 + 2 * (i - 70) : 72 + 2 * (i - 70)]
        messages = []
        for a, b in asked:
            answer = min(a, b) if rng.random() < TEACHER_ERROR else max(a, b)
            messages += [turn("user", question(a, b)), turn("assistant", str(answer))]
        records.append({"messages": messages, "reward_model": {"ground_truth": str(max(asked[-1]))}})
    return records


def pair_records(rng: random.Random) -> list[dict]:
    """60 comparisons: the larger digit chosen, the smaller rejected."""
    records = []
    for a, b in rng.sample(PROBLEMS, 60):
        ask = turn("user", question(a, b))
        records.append(
            {
                "prompt": question(a, b),
                "chosen": [ask, turn("assistant", str(max(a, b)))],
                "rejected": [ask, turn("assistant", str(min(a, b)))],
            }
        )
    return records


def prompt_records() -> list[dict]:
    """Every question, in verl's data schema."""
    return [
        {
            "data_source": "own_data/max",
            "prompt": [turn("user", question(a, b))],
            "ability": "comparison",
            "reward_model": {"style": "rule", "ground_truth": str(max(a, b))},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate(PROBLEMS)
    ]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    out = Path(args.out)
    rng = random.Random(0)
    write_jsonl(out / "sft.jsonl", sft_records(rng))
    write_jsonl(out / "pairs.jsonl", pair_records(rng))
    write_jsonl(out / "prompts.jsonl", prompt_records())
    print(f"wrote sft.jsonl, pairs.jsonl and prompts.jsonl in {out}")


if __name__ == "__main__":
    main()
