"""Held-out curves of pipeline runs (benchmarks/pipelines.sh) beside the CPU's recorded ones.

    python benchmarks/curves.py RUNS_DIR [--recorded book/recorded/arithmetic_cli.json]

Prints, for each run folder under RUNS_DIR with validation lines, val/score (and val/gold when
present) at every evaluated step, with the recorded CPU curve of the same run where there is one.
"""

import argparse
import json
from pathlib import Path


def curve(folder: Path) -> dict[int, dict]:
    """step -> that step's val/* metrics, from a run folder's metrics.jsonl."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: {k: v for k, v in m.items() if k.startswith("val/")} for m in lines if "val/score" in m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs")
    parser.add_argument("--recorded", default="book/recorded/arithmetic_cli.json")
    args = parser.parse_args()
    recorded = json.loads(Path(args.recorded).read_text())["runs"]
    for folder in sorted(Path(args.runs).iterdir()):
        if not (folder / "metrics.jsonl").exists() or not (c := curve(folder)):
            continue
        cpu = {p["step"]: p["val/score"] for p in recorded.get(folder.name, {}).get("curve", [])}
        has_gold = "val/gold" in next(iter(c.values()))  # the first evaluated step, whichever it is
        print(f"{folder.name}: step val/score" + (" (cpu)" if cpu else "") + (" val/gold" if has_gold else ""))
        for step, m in c.items():
            extra = f" ({cpu[step]:.3f})" if step in cpu else ""
            gold = f" {m['val/gold']:.3f}" if "val/gold" in m else ""
            print(f"  {step:5d} {m['val/score']:.3f}{extra}{gold}")


if __name__ == "__main__":
    main()
