"""A model folder checked before it is loaded: what is wrong with it, named in one line.

transformers and safetensors report a wrong folder (a run folder instead of its model, a
checkpoint, a config without weights, a truncated file) with a traceback from deep inside, or
not at all. These checks read only file names, ``config.json`` and the safetensors headers, so
they run in milliseconds, before any model or run folder is touched.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
HEAD_CLASSES = ("ForTokenClassification", "ForSequenceClassification")  # a critic's or reward model's
POSITION_FIELDS = ("max_position_embeddings", "n_positions")


# A missing model folder's fix: refppo never downloads, so a hub id needs a local copy first.
OFFLINE = (
    "refppo loads models offline from a folder written by save_pretrained and never downloads: for a "
    "hub id, save it where the hub is reachable (from_pretrained(id).save_pretrained(folder)) and pass the folder"
)


def _fail(key: str, path: str, problem: str, fix: str) -> None:
    raise ValueError(f"{key}={path}: {problem}; {fix}")


def _safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be loaded (header unreadable, or shorter than its header
    says), or None: the header is 8 bytes of length, then JSON naming each tensor's byte range."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{file.name} is not a safetensors file ({size} bytes)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"{file.name} is not a safetensors file (its header would be {length} bytes of {size})"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{file.name} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{file.name} is not a safetensors file (its header is not a JSON object)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"{file.name} is truncated: {size} bytes of the {expected} its header describes"
    return None


def _shard_names(file: Path) -> list:
    """The shard files a ``*.safetensors.index.json`` names (its weight_map's values)."""
    return list(json.loads(file.read_text())["weight_map"].values())


def _read_config(key: str, path: str, folder: Path) -> dict:
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        _fail(key, path, f"config.json is not valid JSON ({error})", "write the folder again with save_pretrained")
    if not isinstance(config, dict) or "model_type" not in config:
        _fail(key, path, "config.json is not a transformers model config (no model_type)", "point at a model folder")
    return config


def _refppo_folder_fix(folder: Path) -> str | None:
    """The model inside a refppo run or checkpoint folder, as the fix to name, or None."""
    for name in ("model", "actor"):
        if (folder / name / "config.json").is_file():
            return f"it is a refppo run folder: its model is {folder / name}"
    if (folder / "trainer_state.pt").is_file() or (folder / "checkpoints").is_dir():
        run = folder.parent.parent if (folder / "trainer_state.pt").is_file() else folder
        resume = f"trainer.resume=true trainer.output_dir={run}"
        return f"it is a refppo checkpoint or a run without its model: resume it with {resume}"
    return None


def check_model_folder(
    path: str | os.PathLike, key: str, head: bool | None = None, positions: int | None = None
) -> dict:
    """Check a ``save_pretrained`` folder before loading it; returns its ``config.json``.

    Refused, each naming ``key``, the folder, the problem and the fix: a missing path or a file;
    a refppo run or checkpoint folder (the fix names its ``model/`` or ``actor/``); no, or an
    invalid, ``config.json``; unreadable files; no weights; a truncated or foreign safetensors
    file; a value model where a language model belongs (``head=False``); fewer positions than
    ``positions``.

    Args:
        path: the folder.
        key: the setting that named it, e.g. "model.path".
        head: False: must be a causal LM (a reward model's folder would load with a random LM
            head); None: either.
        positions: prompt + response tokens the run needs.

    Returns:
        The folder's ``config.json`` as a dict.
    """
    folder, path = Path(path), os.fspath(path)
    if not folder.exists():
        _fail(key, path, "no such folder", OFFLINE)
    if not folder.is_dir():
        _fail(key, path, "is a file, not a model folder", "point at the folder that holds config.json")
    fix = _refppo_folder_fix(folder)
    if fix is not None:
        _fail(key, path, "is not a model folder", fix)
    if not (folder / "config.json").is_file():
        _fail(key, path, "holds no config.json", "point at a folder written by save_pretrained")
    unreadable = sorted(p.name for p in folder.iterdir() if p.is_file() and not os.access(p, os.R_OK))
    if unreadable:
        _fail(key, path, f"cannot read {', '.join(unreadable)}", "fix the files' permissions")
    config = _read_config(key, path, folder)
    weights = [name for name in WEIGHTS if (folder / name).is_file()]
    if not weights:
        _fail(key, path, f"holds a config but no weights (none of {', '.join(WEIGHTS)})", "save the model again")
    shards = [folder / "model.safetensors"] if "model.safetensors" in weights else []
    if not shards and "model.safetensors.index.json" in weights:
        try:
            shards = [folder / name for name in sorted(set(_shard_names(folder / "model.safetensors.index.json")))]
        except (ValueError, KeyError, AttributeError, TypeError):
            _fail(key, path, "model.safetensors.index.json is not a shard index", "save the model again")
    for shard in shards:
        problem = f"{shard.name} is missing" if not shard.is_file() else _safetensors_problem(shard)
        if problem is not None:
            _fail(key, path, problem, "save the model again")
    architectures = config.get("architectures") or []
    if head is False and any(a.endswith(HEAD_CLASSES) for a in architectures):
        _fail(
            key,
            path,
            f"holds a scalar-head model ({architectures[0]}), not a language model",
            "give the SFT model (<sft run>/model); a reward model goes in reward_model.model.path",
        )
    limit = next((config[f] for f in POSITION_FIELDS if isinstance(config.get(f), int)), None)
    if positions is not None and limit is not None and limit < positions:
        _fail(
            key,
            path,
            f"the model has {limit} positions, fewer than the {positions} of "
            "data.max_prompt_length + data.max_response_length",
            "shorten them or use a model with more positions",
        )
    return config


def check_lora_rank(rank: int, spec: dict, path: str | os.PathLike, setting: str = "model.lora_rank") -> None:
    """Refuse a LoRA rank (``setting``: PEFT's ``model.lora_rank``, Megatron's ``model.lora.rank``)
    above the hidden size in ``spec`` (``path``'s ``config.json``): every linear layer LoRA adapts
    reads or writes the hidden state, so a higher rank adds parameters (and memory) without adding rank."""
    hidden = spec.get("hidden_size")
    if isinstance(hidden, int) and rank > hidden:
        raise ValueError(
            f"{setting}={rank} is above the hidden size {hidden} of {os.fspath(path)}: an adapter of every "
            f"linear layer has rank at most {hidden}; make it at most {hidden}"
        )


def check_lora_adapter(adapter_path: str | os.PathLike, spec: dict, path: str | os.PathLike) -> None:
    """Refuse ``model.lora_adapter_path`` unless it is a saved peft LoRA adapter (its
    ``adapter_config.json`` of peft_type LORA and its weights) whose rank fits the hidden size in
    ``spec`` (``path``'s ``config.json``)."""
    key = "model.lora_adapter_path"
    folder = os.fspath(adapter_path)
    config_file = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{key}={folder}: no adapter_config.json there (a folder peft's save_pretrained wrote)")
    try:
        with open(config_file) as f:
            adapter = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{key}={folder}: adapter_config.json is not readable JSON ({error})") from None
    if adapter.get("peft_type") != "LORA":
        raise ValueError(f"{key}={folder}: a {adapter.get('peft_type')} adapter; refppo starts from LoRA adapters only")
    weights = ("adapter_model.safetensors", "adapter_model.bin")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in weights):
        raise ValueError(f"{key}={folder}: no adapter weights ({' or '.join(weights)})")
    hidden = spec.get("hidden_size")
    rank = adapter.get("r")
    if isinstance(hidden, int) and isinstance(rank, int) and rank > hidden:
        raise ValueError(f"{key}={folder}: its rank {rank} is above the hidden size {hidden} of {os.fspath(path)}")


def check_vocabulary(tokenizer, embeddings: int, key: str, path: str | os.PathLike) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows, beyond the one pad
    token :func:`refppo.rollout.models.prepare_tokenizer` may add (the rest would be random rows).

    Args:
        tokenizer: the run's tokenizer.
        embeddings: the model's embedding rows.
        key, path: the setting and folder, for the message.
    """
    extra = len(tokenizer) - embeddings
    added_pad = extra == 1 and tokenizer.pad_token_id == embeddings
    if extra > 0 and not added_pad:
        _fail(
            key,
            os.fspath(path),
            f"the tokenizer has {len(tokenizer)} tokens but the model only {embeddings} embedding rows",
            "use the tokenizer saved with this model",
        )


def check_same_tokenizer(tokenizer, other, key: str, path: str | os.PathLike) -> None:
    """Refuse a second model (critic, reward model) whose own tokenizer maps text to other ids
    than the actor's: it would read token ids it does not understand.

    Args:
        tokenizer: the actor's tokenizer (from ``model.path``).
        other: the tokenizer saved in the other model's folder, or None if it has none.
        key, path: the other model's setting and folder.
    """
    if other is not None and other.get_vocab() != tokenizer.get_vocab():
        _fail(
            key,
            os.fspath(path),
            "its tokenizer differs from model.path's, so it would read token ids it does not understand",
            "train it from the same SFT model",
        )


def check_remote_code(spec: dict, key: str, path: str | os.PathLike, trust_key: str, trusted: bool, auto_class: str):
    """Refuse a folder whose model only its own Python code builds (``config.json``'s ``auto_map``
    for a ``model_type`` transformers lacks) unless ``trust_key`` is true; and, trusted, one whose
    ``auto_map`` lacks the configuration or ``auto_class``, names code in another repository, or
    names a module the folder does not hold: transformers would fail deep inside, or go online.

    Args:
        spec: the folder's ``config.json`` (from :func:`check_model_folder`).
        key, path: the setting that named the folder, and the folder.
        trust_key: the setting that allows its code, e.g. "model.trust_remote_code".
        trusted: that setting's value.
        auto_class: the Auto class the run builds from it: "AutoModelForCausalLM" for the actor,
            "AutoModelForTokenClassification" for a critic or reward model.
    """
    from transformers import CONFIG_MAPPING

    auto_map = spec.get("auto_map")
    if not isinstance(auto_map, dict) or spec["model_type"] in CONFIG_MAPPING:
        return  # transformers' own classes build it, whatever the folder ships
    path = os.fspath(path)
    if not trusted:
        modules = sorted({f"{ref.split('.')[0]}.py" for ref in auto_map.values() if isinstance(ref, str)})
        _fail(
            key,
            path,
            f"its model (model_type {spec['model_type']!r}) is built by the folder's own Python code "
            f"({', '.join(modules)}, config.json's auto_map), which runs only with {trust_key}=true",
            f"set {trust_key}=true if you trust that code (it runs with your permissions)",
        )
    for needed in ("AutoConfig", auto_class):
        ref = auto_map.get(needed)
        if not isinstance(ref, str):
            _fail(
                key,
                path,
                f"its own code defines no {needed} (auto_map has {', '.join(auto_map)})",
                "add it to the code",
            )
        if "--" in ref:
            _fail(key, path, f"auto_map's {needed} is code in another repository ({ref})", "copy it into the folder")
        if not (Path(path) / f"{ref.split('.')[0]}.py").is_file():
            _fail(key, path, f"auto_map's {needed} ({ref}) names a module the folder lacks", "copy it into the folder")
