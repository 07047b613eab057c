"""Record the ``python3 -m verl.trainer.main_ppo`` command lines of verl's example scripts.

Each script under ``examples/`` of a verl checkout (a git tag) is run by bash as it is, with its
own defaults, but with a stand-in ``python3`` first on the PATH: called as
``python3 -m verl.trainer.main_ppo ...`` it writes the arguments bash expanded, and it fails any
other call (so ``python3 -c 'import torch_npu'`` probes answer "no NPU"). Other programs the
scripts call (``nvidia-smi``, ``ray``, ``hf``, ...) are stand-ins that print nothing. Nothing of
verl is imported or run. The result, ``verl_0_9_0_examples.json``, holds for each script that
launches ``main_ppo`` its path and the settings it passes, in order; ``tests/test_verl_examples.py``
reads it.

Usage (from the project root, with a verl checkout, e.g. the snapshot ``fetch`` brings)::

    python tests/data/record_verl_examples.py /path/to/verl.git v0.9.0
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("verl_0_9_0_examples.json")
STAND_IN_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "verl.trainer.main_ppo" ]; then
    shift 2
    for arg in "$@"; do printf '%s\\0' "$arg"; done > "$RECORD_TO"
    exit 0
fi
exit 1
"""
# bash functions come before builtins: a script's ``ulimit -n`` may not raise the limit here
PRELUDE = "ulimit() { :; }\n"
# variables some scripts require the user to set (``${X:?must set X}`` or ``set -u``), as a user would
USER_SET = {
    "HDFS_ROOT": "/data",
    "DATA_ROOT": "/data",
    "CKPT_DIR": "/data/checkpoints",
    "RAY_DATA_HOME": "/data",
    "INFER_BACKEND": "vllm",
    "LORA_ADAPTER_PATH": "/data/lora_adapter",
    "KIMI_K2_6_MODEL_PATH": "/data/model",
}
QUIET_PROGRAMS = ("nvidia-smi", "ray", "hf", "huggingface-cli", "wandb", "npu-smi", "pip", "pip3", "wget", "curl")


def script_paths(git_dir: str, tag: str) -> list[str]:
    """The example scripts (``examples/**.sh``) of ``tag`` that name ``verl.trainer.main_ppo``."""
    listed = subprocess.run(
        ["git", "-C", git_dir, "grep", "-l", "verl.trainer.main_ppo", tag, "--", "examples/*.sh"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(line.split(":", 1)[1] for line in listed)


def stand_ins(folder: Path) -> None:
    """Write the stand-in programs into ``folder``."""
    programs = {"python3": STAND_IN_PYTHON, "python": STAND_IN_PYTHON}
    programs |= {name: "#!/bin/sh\nexit 0\n" for name in QUIET_PROGRAMS}
    for name, text in programs.items():
        path = folder / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def record(git_dir: str, tag: str, script: str, bin_dir: Path, work: Path) -> list[str] | None:
    """The settings ``script`` passes to main_ppo, or None when running it launched none."""
    text = subprocess.run(
        ["git", "-C", git_dir, "show", f"{tag}:{script}"], capture_output=True, text=True, check=True
    ).stdout
    local = work / Path(script).name
    local.write_text(PRELUDE + text)
    record_to = work / "argv"
    record_to.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(work / "home"),
        "RECORD_TO": str(record_to),
        **USER_SET,
    }
    subprocess.run(["bash", str(local)], cwd=work, env=env, capture_output=True, timeout=60, check=False)
    if not record_to.exists():
        return None
    return [arg for arg in record_to.read_text().split("\0") if arg]


def main(git_dir: str, tag: str) -> None:
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        stand_ins(bin_dir)
        work = Path(tmp) / "work"
        (work / "home").mkdir(parents=True)
        for script in script_paths(git_dir, tag):
            settings = record(git_dir, tag, script, bin_dir, work)
            if settings is None:
                print(f"no main_ppo launch: {script}", file=sys.stderr)
                continue
            records.append({"script": script, "settings": settings})
    OUT.write_text(json.dumps({"verl": tag, "lines": records}, indent=1) + "\n")
    print(f"{len(records)} lines written to {OUT}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or not os.path.isdir(sys.argv[1]):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
