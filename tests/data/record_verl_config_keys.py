"""Record every leaf key of verl's generated trainer configurations, with its default.

verl ships its composed Hydra configurations as ``verl/trainer/config/_generated_ppo_trainer.yaml``
(the FSDP engine), ``_generated_ppo_megatron_trainer.yaml`` (Megatron), ``_veomni_`` and
``_torchtitan_`` (``model_engine=veomni`` / ``torchtitan``). This flattens each to
``{dotted key: default}``: a leaf is a value that is not a mapping, or an empty mapping; the
``_target_`` keys (which dataclass Hydra builds) are left out.

Hydra builds each mapping with a ``_target_`` into that config dataclass, which may have fields the
YAML lacks: a verl command line gives them with ``+key=value``. They are recorded apart, as
``dataclass_keys`` (``{dotted key: {"default", "class", "file"}}``), read from the dataclasses'
source with ``ast`` (verl is not imported). A field whose type is another config dataclass is
followed to its leaves; inherited fields count.

The result, ``verl_0_9_0_ppo_<engine>_trainer_keys.json`` (``verl_0_9_0_ppo_trainer_keys.json`` for
FSDP), is what ``tests/test_verl_names.py`` checks refppo knows.

Usage (from the project root, with a verl checkout, e.g. the snapshot ``fetch`` brings)::

    python tests/data/record_verl_config_keys.py /path/to/verl.git v0.9.0 megatron  # or fsdp, veomni, torchtitan
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import yaml

FILES = {
    "fsdp": ("_generated_ppo_trainer.yaml", "verl_0_9_0_ppo_trainer_keys.json"),
    "megatron": ("_generated_ppo_megatron_trainer.yaml", "verl_0_9_0_ppo_megatron_trainer_keys.json"),
    "veomni": ("_generated_ppo_veomni_trainer.yaml", "verl_0_9_0_ppo_veomni_trainer_keys.json"),
    "torchtitan": ("_generated_ppo_torchtitan_trainer.yaml", "verl_0_9_0_ppo_torchtitan_trainer_keys.json"),
}
# where verl 0.9 defines the config dataclasses its YAML names in _target_
CLASS_FILES = (
    "verl/workers/config/",
    "verl/trainer/config/",
    "verl/utils/profiler/config.py",
    "verl/utils/skip/config.py",
)
# a field this deep in nested config dataclasses is recorded as a leaf
MAX_DEPTH = 4


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


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def config_classes(repo: str, tag: str) -> dict:
    """Every class in verl's config files: name -> (base names, {field: (annotation, default)}, file).
    A field is a class-level annotated name that is not private and not a ClassVar."""
    listed = _git(repo, "ls-tree", "-r", "--name-only", tag, "--", *CLASS_FILES).split()
    paths = [path for path in listed if path.endswith(".py")]
    classes = {}
    for path in paths:
        for node in ast.parse(_git(repo, "show", f"{tag}:{path}")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {}
            for statement in node.body:
                if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                    continue
                annotation = ast.unparse(statement.annotation)
                if statement.target.id.startswith("_") or "ClassVar" in annotation:
                    continue
                default = ast.unparse(statement.value) if statement.value is not None else None
                fields[statement.target.id] = (annotation, default)
            classes[node.name] = ([ast.unparse(b).split(".")[-1] for b in node.bases], fields, path)
    return classes


def all_fields(classes: dict, name: str) -> dict:
    """The fields of class ``name``, its bases' first (a subclass's own field wins)."""
    if name not in classes:
        return {}
    bases, fields, _ = classes[name]
    out = {}
    for base in bases:
        out |= all_fields(classes, base)
    return out | fields


def _field_class(classes: dict, annotation: str) -> str | None:
    """The config dataclass a field's annotation names (``Optional[X]`` is X), if it has fields."""
    name = annotation.removeprefix("Optional[").removesuffix("]").split(".")[-1]
    return name if all_fields(classes, name) else None


def _default_text(default: str | None) -> str | None:
    """A field's default as a command line gives it: a literal's value, else null."""
    try:
        value = ast.literal_eval(default) if default is not None else None
    except ValueError:
        return None
    return None if isinstance(value, (dict, list, tuple)) else value


def _field_leaves(classes: dict, name: str, prefix: str, depth: int = 0) -> dict:
    """Each field of class ``name`` as ``{prefix + dotted field: record}``, nested config
    dataclasses followed to their leaves."""
    out = {}
    for field, (annotation, default) in all_fields(classes, name).items():
        inner = _field_class(classes, annotation)
        if inner is not None and depth < MAX_DEPTH:
            out |= _field_leaves(classes, inner, f"{prefix}{field}.", depth + 1)
        else:
            out[prefix + field] = {"default": _default_text(default), "class": name, "file": classes[name][2]}
    return out


def dataclass_keys(tree: dict, classes: dict, prefix: str = "") -> dict:
    """The fields of the dataclasses ``tree``'s ``_target_`` keys name that the YAML lacks there."""
    out = {}
    target = tree.get("_target_")
    if isinstance(target, str):
        name = target.split(".")[-1]
        for field, record in _field_leaves(classes, name, prefix).items():
            head = field[len(prefix) :].split(".")[0]
            if head not in tree:
                out[field] = record
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= dataclass_keys(value, classes, f"{prefix}{key}.")
    return out


def main(repo: str, tag: str, engine: str) -> None:
    name, out = FILES[engine]
    path = f"verl/trainer/config/{name}"
    tree = yaml.safe_load(_git(repo, "show", f"{tag}:{path}"))
    record = {
        "source": f"verl-project/verl {tag}, {path}: every leaf key and its default "
        "(an empty mapping is a leaf; without _target_ keys); dataclass_keys: the fields of the "
        f"dataclasses its _target_ keys name ({', '.join(CLASS_FILES)}) that it lacks",
        "defaults": leaves(tree),
        "dataclass_keys": dataclass_keys(tree, config_classes(repo, tag)),
    }
    Path(__file__).with_name(out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
