"""Run folders: the resolved config, ``metrics.jsonl`` (one line per step) and checkpoints.

A checkpoint is written into a temporary folder and renamed into place, and ``latest`` is
replaced atomically after it, so a crash while saving never damages the last good checkpoint.

Layout::

    run/config.json  run/metrics.jsonl  run/latest  run/checkpoints/step_000010/...
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from refppo.config import Config, save_config


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_free(path: str | os.PathLike) -> None:
    """Raise FileExistsError if ``path`` already holds a run (a non-empty folder)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"run folder {str(path)!r} already holds a run; pick a new trainer.output_dir "
            "or set trainer.resume=true to continue it"
        )


class RunFolder:
    """One run's folder.

    Args:
        path: the folder.
        config: the resolved config, written to ``config.json``.
        resume: continue a run in ``path`` (its metrics after the last checkpoint are dropped);
            without it an existing non-empty folder is refused, so no run is written over
            another.
    """

    def __init__(self, path: str | os.PathLike, config: Config, resume: bool = False):
        self.path = Path(path)
        if not resume:
            check_free(self.path)
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)
        save_config(config, self.path / "config.json")
        self.metrics_path = self.path / "metrics.jsonl"
        self.tensorboard = None
        if resume:
            step = self.latest_step() or 0
            self._truncate_metrics(step)

    def latest_step(self) -> int | None:
        """The step of the last complete checkpoint, or None."""
        latest = self.path / "latest"
        return int(latest.read_text()) if latest.exists() else None

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step_{step:06d}"

    def _truncate_metrics(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        lines = [ln for ln in self.metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        _atomic_write_text(self.metrics_path, "".join(ln + "\n" for ln in lines))

    def enable_tensorboard(self) -> None:
        """Also write every metric to TensorBoard event files under ``tensorboard/``."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("trainer.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
        self.tensorboard = SummaryWriter(str(self.path / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one JSON line ``{"step": step, **metrics}`` (non-finite values as null)."""
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tensorboard is not None:
            for k, v in metrics.items():
                self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()

    def save_checkpoint(self, step: int, write) -> Path:
        """Write a checkpoint for ``step``: ``write(folder)`` fills a temporary folder, which is
        then renamed into place and recorded in ``latest``.

        Returns:
            The checkpoint folder.
        """
        final = self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():  # a re-save of the same step: keep the old one until the new is in place
            os.replace(final, old)
        os.replace(tmp, final)
        _atomic_write_text(self.path / "latest", str(step))
        shutil.rmtree(old, ignore_errors=True)
        return final
