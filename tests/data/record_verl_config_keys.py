"""Record every leaf key of verl's generated trainer configurations, with its default.

verl ships its composed Hydra configurations as ``verl/trainer/config/_generated_ppo_trainer.yaml``
(the FSDP engine) and ``_generated_ppo_megatron_trainer.yaml`` (Megatron). This flattens each to
``{dotted key: default}``: a leaf is a value that is not a mapping, or an empty mapping; the
``_target_`` keys (which dataclass Hydra builds) are left out. The result,
``verl_0_9_0_ppo_trainer_keys.json`` (FSDP) or ``verl_0_9_0_ppo_megatron_trainer_keys.json``, is what
``tests/test_verl_names.py`` checks refppo knows.

Usage (from the project root, with a verl checkout, e.g. the snapshot ``fetch`` brings)::

    python tests/data/record_verl_config_keys.py /path/to/verl.git v0.9.0 megatron
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

FILES = {
    "fsdp": ("_generated_ppo_trainer.yaml", "verl_0_9_0_ppo_trainer_keys.json"),
    "megatron": ("_generated_ppo_megatron_trainer.yaml", "verl_0_9_0_ppo_megatron_trainer_keys.json"),
}


def leaves(tree: dict, prefix: str = "") -> dict:
    """``tree``'s leaf values by dotted key (an empty mapping is a leaf; ``_target_`` is left out)."""
    out = {}
    for key, value in tree.items():
        if key == "_target_":
            continue
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def main(repo: str, tag: str, engine: str) -> None:
    name, out = FILES[engine]
    path = f"verl/trainer/config/{name}"
    text = subprocess.run(["git", "-C", repo, "show", f"{tag}:{path}"], check=True, capture_output=True, text=True)
    record = {
        "source": f"verl-project/verl {tag}, {path}: every leaf key and its default "
        "(an empty mapping is a leaf; without _target_ keys)",
        "defaults": leaves(yaml.safe_load(text.stdout)),
    }
    Path(__file__).with_name(out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
