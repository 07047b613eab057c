"""Run the README's arithmetic pipeline from the CLI and record its curves for chapter 5b.

    python book/recorded/record_arithmetic.py [--out book/recorded/arithmetic_cli.json]

Runs ``refppo sft``, then ``refppo ppo`` (GAE) and ``refppo ppo`` (GRPO) from the SFT model,
and, as the negative control, SFT on a teacher who never carries followed by PPO. Each command
runs in a fresh folder under a temporary directory, one after the other, with the default seed.
The held-out curves, the wall time of each command and the machine go to a small JSON file,
which the chapter plots and quotes; rerun this script after changing the package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PIPELINE = {
    "sft": ["sft"],
    "ppo": ["ppo", "model.path={sft}/model"],
    "grpo": [
        "ppo",
        "model.path={sft}/model",
        "algorithm.adv_estimator=grpo",
        "rollout.n=8",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8",
    ],
    "sft_never": ["sft", "sft.teacher_carry_error=1.0"],
    "ppo_never": ["ppo", "model.path={sft_never}/model", "trainer.total_training_steps=600", "trainer.test_freq=50"],
}
KEYS = ("val/score", "val/score_sampled", "val/response_length")


def run(name: str, args: list[str], root: Path) -> dict:
    folder = root / name
    paths = {"sft": root / "sft", "sft_never": root / "sft_never"}
    cmd = [sys.executable, "-m", "refppo", *[a.format(**paths) for a in args], f"trainer.output_dir={folder}"]
    cmd.append("trainer.progress_bar=false")
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    curve = [{"step": m["step"], **{k: m[k] for k in KEYS if k in m}} for m in lines if "val/score" in m]
    return {
        "command": "refppo " + " ".join(cmd[3:]),
        "wall_s": round(wall, 1),
        "steps": lines[-1]["step"],
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("arithmetic_cli.json")))
    out = Path(parser.parse_args().out)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = {name: run(name, args, root) for name, args in PIPELINE.items()}
    for r in runs.values():  # the SFT run has no held-out curve
        r["command"] = r["command"].replace(str(root), "runs")
    record = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
