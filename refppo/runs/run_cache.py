"""The chapters' cache of finished runs: ``refppo <command> <overrides>`` run once, its folder
reused while the settings and refppo's source stay the same."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from refppo.runs.cli import COMMANDS, main
from refppo.settings.config import Config, apply_overrides, config_to_dict
from refppo.settings.validate import validate


def _source_digest() -> str:
    """A hash of refppo's own source files, every module of the package: a cached run is stale once
    the package changes."""
    root = Path(__file__).parents[1]  # refppo/, not this module's refppo/runs/
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cached_run(command: str, overrides: list[str], cache_dir: str | os.PathLike | None = None) -> Path:
    """Run ``refppo <command> <overrides>`` once; later calls return the finished run folder.

    The folder's name hashes the command, its resolved config, the contents of its data files
    (``data.train_files``, ``data.val_files``) and refppo's source, so a changed setting, file or
    package runs again. The run is written to a temporary folder that is
    renamed into place only when it has finished, so an interrupted run is never reused. This is
    how the chapters reuse the checkpoints they train.

    Args:
        command: "sft", "rm" or "ppo".
        overrides: dotted ``key=value`` settings (``trainer.output_dir`` is chosen here).
        cache_dir: where runs are kept; default ``$REFPPO_CACHE`` or ``~/.cache/refppo``.

    Returns:
        The run folder (``<folder>/model`` or ``<folder>/actor`` holds the trained model).
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; valid: {', '.join(COMMANDS)}")
    config = validate(
        apply_overrides(Config(), [*overrides, "trainer.output_dir=-", "trainer.progress_bar=false"]), command
    )
    files = [*(config.data.train_files or ()), *(config.data.val_files or ())]
    data = {path: hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in files if Path(path).is_file()}
    spec = json.dumps(
        {"command": command, "config": config_to_dict(config), "data": data, "source": _source_digest()},
        sort_keys=True,
    )
    root = Path(cache_dir or os.environ.get("REFPPO_CACHE") or Path.home() / ".cache" / "refppo")
    final = root / f"{command}-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"
    if final.is_dir():
        return final
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    main([command, *overrides, f"trainer.output_dir={tmp}", "trainer.progress_bar=false"])
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished the same run first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return final
