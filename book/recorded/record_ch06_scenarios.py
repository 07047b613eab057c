"""Run chapter 6's KL scenarios (§6.4) on many seeds and record what each run reports, for the
claims the chapter makes about them.

    python book/recorded/record_ch06_scenarios.py [--seeds 12] [--out book/recorded/ch06_scenarios.json]

The chapter runs each setting on 3 seeds, too few for its claims to hold on every machine (a run's
last bits, and so its trajectory, differ from one CPU to another). This script executes the
chapter's own code cells, in a kernel, up to the one tagged ``scenario-settings`` (the
settings and what a run reports), then runs every setting on seeds 0 .. N-1 with the chapter's
``train`` and writes, per setting and seed, the mean of each reported metric over the last 10
steps and the last KL coefficient used. It takes about 3 minutes on 2 CPU cores; rerun it after a
change to the chapter's settings or to the package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

BOOK = Path(__file__).resolve().parent.parent
CHAPTER = BOOK / "ch06_dual_kl.ipynb"
TAG = "scenario-settings"

RECORD = """
import json as _json

_record = {{}}
for _name, _overrides in scenarios.items():
    _record[_name] = []
    for _seed in range({seeds}):
        _metrics = train(_overrides, seed=_seed)[1]
        _late = {{key: late(_metrics, key) for key in LATE_KEYS}}
        _late["actor/reward_kl_penalty_coeff"] = _metrics[-1]["actor/reward_kl_penalty_coeff"]
        _record[_name].append(_late)
print("RECORD " + _json.dumps(_record))
"""


def chapter_up_to_settings(seeds: int) -> nbformat.NotebookNode:
    """Chapter 6's code cells up to the tagged settings cell, then the recording cell."""
    nb = nbformat.read(CHAPTER, as_version=4)
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cells.append(cell)
        if TAG in cell.metadata.get("tags", []):
            break
    else:
        raise ValueError(f"{CHAPTER.name} has no code cell tagged {TAG!r}")
    nb.cells = [*cells, nbformat.v4.new_code_cell(RECORD.format(seeds=seeds))]
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--out", default=str(BOOK / "recorded" / "ch06_scenarios.json"))
    args = parser.parse_args()
    nb = chapter_up_to_settings(args.seeds)
    NotebookClient(nb, timeout=3600, resources={"metadata": {"path": str(BOOK)}}).execute()
    text = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    line = next(line for line in text.splitlines() if line.startswith("RECORD "))
    record = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "seeds": args.seeds,
        "runs": json.loads(line.removeprefix("RECORD ")),
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
