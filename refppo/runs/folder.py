"""Run folders: the resolved config, ``metrics.jsonl`` (one line per step) and checkpoints.

A checkpoint is written into a temporary folder and renamed into place, and ``latest`` is
replaced atomically after it, so a crash while saving never damages the last good checkpoint.
A resume trusts no single file: :func:`check_resume` loads the newest checkpoint that loads
(``latest`` is only for people), and nothing in the folder changes before every check passed.

Layout::

    run/config.json  run/metrics.jsonl  run/latest
    run/checkpoints/step_000010/trainer_state.pt   the step, schedules, data position, generators
    run/checkpoints/step_000010/models/            the models and optimisers (torch.distributed.checkpoint)

With several processes only the first writes, except the models' shards, which each writes; the
models' checkpoint reads back into any number of processes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from refppo.distributed import SINGLE, World, barrier
from refppo.runs.loggers import check_installed, open_loggers
from refppo.settings.conditions import CRITIC_FROM_ACTOR
from refppo.settings.config import Config, config_to_dict, flatten
from refppo.settings.validate import resumable_settings
from refppo.training.checkpoint import MODELS, STATE_FILE


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _config_json(config: Config) -> str:
    return json.dumps(config_to_dict(config), indent=2)


def holds_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a non-empty folder, other than one holding only the ``config.json`` of a
    refppo run that stopped before its first step (nothing to keep or resume: a run may start
    there)."""
    path = Path(path)
    if not path.is_dir():
        return False
    names = [p.name for p in path.iterdir()]
    return bool(names) and not (names == ["config.json"] and _is_refppo_config(path / "config.json"))


def _is_refppo_config(file: Path) -> bool:
    """Whether ``file`` is a config.json refppo wrote (a JSON object with its sections)."""
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and set(config_to_dict(Config())) <= set(saved)


def check_writable(path: str | os.PathLike) -> None:
    """Raise OSError naming the path unless a run can be written at ``path``: its nearest existing
    folder (itself, or the parent to create it in) is a writable folder, the folders to create
    have names the file system takes, and a ``latest`` in it is a file."""
    path = Path(path).absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as error:  # a name the file system refuses, such as one too long
        raise OSError(error.errno, f"trainer.output_dir={str(path)[:60]!r}...: {error.strerror}") from None
    if not existing.is_dir():
        raise NotADirectoryError(f"trainer.output_dir={str(path)!r}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"trainer.output_dir={str(path)!r}: cannot write in {existing}")
    if (path / "latest").is_dir():
        raise IsADirectoryError(
            f"trainer.output_dir={str(path)!r}: its latest is a folder; refppo writes the last checkpoint's step "
            "there: move it away"
        )


def hold_lock(path: Path) -> int:
    """Take the run folder's lock (an exclusive ``flock`` on the folder itself, so it adds no file)
    for as long as the returned descriptor stays open: the system drops it when the process ends,
    however it ends. Raises FileExistsError, before anything is written, if another process holds it.

    Args:
        path: an existing run folder.

    Returns:
        The folder's open file descriptor (``os.close`` it to let go).
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise FileExistsError(
            f"run folder {str(path)!r} is in use by another refppo process; wait for it to end, or pick another "
            "trainer.output_dir"
        ) from None
    return descriptor


def check_unlocked(path: str | os.PathLike) -> None:
    """Raise FileExistsError if another process is writing the run folder ``path`` (it holds the
    lock :func:`hold_lock` takes); a missing folder is free."""
    path = Path(path)
    if path.is_dir():
        os.close(hold_lock(path))


def check_free(path: str | os.PathLike, resumable: bool = True) -> None:
    """Raise FileExistsError if ``path`` already holds a run (a non-empty folder); the message
    offers ``trainer.resume=true`` only where the command reads it (``resumable``)."""
    if holds_run(path):
        resume = " or set trainer.resume=true to continue it" if resumable else ""
        raise FileExistsError(f"run folder {str(path)!r} already holds a run; pick a new trainer.output_dir{resume}")


@dataclass
class Resume:
    """What :func:`check_resume` found: the checkpoint to continue from and the log to keep.

    Attributes:
        step: the checkpoint's step.
        state: the trainer state saved there (``PPOTrainer.load_checkpoint`` takes it with the folder).
        metrics: the lines of ``metrics.jsonl`` up to ``step``, each ending in a newline.
        notes: what was passed over (unreadable checkpoints, a torn last log line), and the
            settings newer than the run, taken at their defaults.
        folder: the checkpoint's folder.
    """

    step: int
    state: dict
    metrics: list[str]
    notes: list[str]
    folder: Path


def _checkpoints(path: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete-looking checkpoint, newest first."""
    found = []
    for folder in (path / "checkpoints").glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", folder.name)
        if match and folder.is_dir():
            found.append((int(match.group(1)), folder))
    return sorted(found, reverse=True)


def _critic_resolved(flat: dict) -> dict:
    """A flattened config with each unset critic setting replaced by the actor's, so a run saved
    with the value explicit resumes where it means the same."""
    return flat | {f"critic.{n}": flat.get(f"actor.{n}") for n in CRITIC_FROM_ACTOR if flat.get(f"critic.{n}") is None}


def _schedule_length_changes(saved: dict, new: dict, free: set) -> list[str]:
    """The run's length changed (``trainer.total_training_steps`` or ``trainer.total_epochs``, each
    resumable alone) while a learning-rate schedule is laid out over it (a cosine decay, or a
    warm-up of ``lr_warmup_steps_ratio`` of the run): each such change, as ``check_resume`` lists
    them; the steps already run followed the old length's schedule, so the resumed run would match
    no run of either length."""
    lengths = [k for k in ("trainer.total_training_steps", "trainer.total_epochs") if saved.get(k) != new.get(k)]
    laid_out = []
    for role in ("actor", "critic"):
        if f"{role}.optim.lr" in free:  # a critic the run does not have
            continue
        if new.get(f"{role}.optim.lr_scheduler_type") == "cosine":
            laid_out.append(f"{role}.optim.lr_scheduler_type=cosine")
        if new.get(f"{role}.optim.lr_warmup_steps", 0) <= 0 and new.get(f"{role}.optim.lr_warmup_steps_ratio", 0) > 0:
            laid_out.append(f"{role}.optim.lr_warmup_steps_ratio={new[f'{role}.optim.lr_warmup_steps_ratio']}")
    if not laid_out:
        return []
    return [
        f"{k}: {saved.get(k)!r} -> {new.get(k)!r} (the schedule of {', '.join(laid_out)} spans it)" for k in lengths
    ]


def check_resume(path: str | os.PathLike, config: Config) -> Resume | None:
    """Everything a resume needs, read and checked without writing anything.

    Refuses (ValueError) a folder whose ``config.json`` differs from ``config`` in a setting
    a resumed run may not change (all listed; :func:`refppo.settings.validate.resumable_settings`: those
    declared resumable, and those ``config`` ignores, as
    one saved by a run from before refppo refused it, and critic settings compare as resolved),
    one with no checkpoint that loads, and a
    metrics log damaged anywhere but its last line (a line torn by a kill is dropped).

    Args:
        path: the run folder.
        config: the resumed run's config.

    Returns:
        None when ``path`` is missing or empty (nothing to resume: the run starts fresh),
        else the newest checkpoint that loads.
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not holds_run(path):
        return None
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resume {str(path)!r}: its config.json is unreadable ({e})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"cannot resume {str(path)!r}: its config.json holds a {type(saved).__name__}, not settings")
    new = flatten(json.loads(_config_json(config)))  # through JSON, as saved: tuples become lists
    defaults = flatten(json.loads(_config_json(Config())))
    saved = flatten(saved)
    newer = [k for k in new if k not in saved and k in defaults]
    # a setting newer than the run: the run had its default (refppo's defaults keep what it computed)
    newer_notes = [f"{k} is newer than the run's config.json: taken at its default, {defaults[k]!r}" for k in newer]
    saved = {k: defaults[k] for k in newer} | saved
    saved = _critic_resolved(saved)
    new = _critic_resolved(new)
    free = resumable_settings(config)
    changed = [
        f"{k}: {saved.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(saved) | set(new))
        if k not in free and saved.get(k) != new.get(k)
    ]
    changed += _schedule_length_changes(saved, new, free)
    if changed:
        raise ValueError(
            f"cannot resume {str(path)!r} with different settings (a resumed run must mean the same run); "
            f"changed: {'; '.join(changed)}. Start a new run in another trainer.output_dir instead"
        )
    notes = []
    for step, folder in _checkpoints(path):
        try:
            state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
            if state["step"] != step:
                raise ValueError(f"it holds step {state['step']}")
            FileSystemReader(folder / MODELS).read_metadata()  # the models' shards are all listed there
        except Exception as e:  # torch raises many kinds for a truncated or foreign file
            notes.append(f"{folder.name} does not load ({type(e).__name__}: {e}); left in place")
            continue
        total = config.trainer.total_training_steps
        if total is not None and step > total:
            raise ValueError(
                f"cannot resume {str(path)!r}: its checkpoint is at step {step}, beyond "
                f"trainer.total_training_steps={total}. Nothing was changed; ask for at least {step} steps"
            )
        if not (path / "metrics.jsonl").is_file():
            raise ValueError(
                f"cannot resume {str(path)!r}: its metrics.jsonl is missing, so the log of steps 1-{step} "
                "would be lost. Nothing was changed; restore the file, or start a new run"
            )
        metrics = _metrics_until(path / "metrics.jsonl", step, notes)
        return Resume(step, state, metrics, newer_notes + notes, folder)
    raise ValueError(
        f"cannot resume {str(path)!r}: it holds no checkpoint that loads ({'; '.join(notes) or 'none saved yet'}). "
        "Nothing was changed; start a new run in another trainer.output_dir"
    )


def _read_log(file: Path) -> tuple[list[tuple[str, dict]], bool]:
    """A metrics log's (line, record) pairs, and whether a torn last line (a kill mid-write)
    was left out; damage anywhere else is refused by file and line."""
    lines = file.read_text().splitlines() if file.exists() else []
    pairs = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if n < len(lines):
                raise ValueError(f"{file}:{n} is not a JSON line") from None
            return pairs, True
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{file}:{n} is not a metrics record (a JSON object with an integer step)")
        pairs.append((line, record))
    return pairs, False


def _metrics_until(path: Path, step: int, notes: list[str]) -> list[str]:
    """The log's lines up to ``step``; a torn last line is dropped (noted), other damage refused."""
    pairs, torn = _read_log(path)
    if torn:
        notes.append(f"the torn last line of {path.name} was dropped")
    return [line + "\n" for line, record in pairs if record["step"] <= step]


class RunFolder:
    """One run's folder.

    Args:
        path: the folder.
        config: the resolved config, written to ``config.json``.
        resume: what :func:`check_resume` found, to continue that run: its metrics after the
            checkpoint are dropped. Without it an existing non-empty folder is refused, so no
            run is written over another.
        world: the run's processes: only the first writes (the others join checkpoints).
    """

    def __init__(self, path: str | os.PathLike, config: Config, resume: Resume | None = None, world: World = SINGLE):
        self.path = Path(path)
        self.resume = resume
        self.world = world
        self.metrics_path = self.path / "metrics.jsonl"
        self.generations_path = self.path / "val_generations.jsonl"
        self.loggers = []
        self.lock = None
        if not world.main:
            return
        check_installed(config.trainer.logger)
        if resume is None:
            check_free(self.path)
        self.path.mkdir(parents=True, exist_ok=True)  # checkpoints/ comes with the first checkpoint
        # one process writes a folder: a second run there (a resume started while it trains) is refused
        self.lock = hold_lock(self.path)
        _atomic_write_text(self.path / "config.json", _config_json(config))
        self.loggers = open_loggers(config, self.path)
        if resume is not None:
            # as the metrics, the validation samples of steps after the checkpoint are dropped
            kept = _metrics_until(self.generations_path, resume.step, resume.notes)
            _atomic_write_text(self.metrics_path, "".join(resume.metrics))
            if self.generations_path.exists():
                _atomic_write_text(self.generations_path, "".join(kept))
            for note in resume.notes:
                print(f"refppo: {note}", file=sys.stderr)
            print(f"refppo: resuming {self.path} from step {resume.step}", file=sys.stderr)

    def latest_step(self) -> int | None:
        """The step recorded in ``latest`` (the last checkpoint this folder completed), or None."""
        latest = self.path / "latest"
        return int(latest.read_text()) if latest.exists() else None

    def checkpoint_dir(self, step: int) -> Path:
        """The folder of the checkpoint saved after ``step`` (``checkpoints/step_000012``)."""
        return self.path / "checkpoints" / f"step_{step:06d}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one JSON line ``{"step": step, **metrics}`` (non-finite values as null), and pass
        the metrics to ``trainer.logger``'s loggers (:mod:`refppo.runs.loggers`)."""
        if not self.world.main:
            return
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self, ok: bool = True) -> None:
        """End the runs of ``trainer.logger``'s loggers (marked failed unless ``ok``), and let go of
        the folder's lock."""
        for logger in self.loggers:
            logger.close(ok)
        self.loggers = []
        self._let_go()

    def _let_go(self) -> None:
        """Close the folder's lock (:func:`hold_lock`), once."""
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def __del__(self) -> None:
        # a run folder no one holds any more (a run made in Python and never closed) lets go of its lock
        self._let_go()

    def log_generations(self, step: int, samples: list[dict]) -> None:
        """Append one JSON line ``{"step": step, **sample}`` per validation sample
        (``trainer.log_val_generations``) to ``val_generations.jsonl``."""
        if self.world.main:
            with open(self.generations_path, "a") as f:
                f.writelines(json.dumps({"step": step, **sample}) + "\n" for sample in samples)

    def save_checkpoint(self, step: int, write) -> Path:
        """Write a checkpoint for ``step``: ``write(folder)`` fills a temporary folder (on every
        process), which is then renamed into place and recorded in ``latest``. A folder already
        there for ``step`` (e.g. one a resume passed over as unreadable) is kept, renamed
        ``<name>.replaced[-k]``. A failed write (disk full) removes its partial folder and says how
        much space is left.

        Returns:
            The checkpoint folder.
        """
        final = self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.world.main:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial write of this same run, killed
            tmp.mkdir(parents=True)
        barrier(self.world)
        try:
            write(tmp)
            barrier(self.world)
        except Exception as e:
            if not self.world.main:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.path).free
            full = free < 2**20 or any(
                getattr(x, "errno", None) == errno.ENOSPC for x in (e, e.__cause__, e.__context__)
            )
            raise OSError(
                f"{'no space left on the disk: ' if full else ''}writing checkpoint {final.name} failed ({e}); "
                f"{free / 2**20:.0f} MiB free. The last good checkpoint (step {self.latest_step()}) is intact"
            ) from e
        if not self.world.main:
            return final
        if final.exists():
            aside = final.with_name(final.name + ".replaced")
            k = 1
            while aside.exists():
                k += 1
                aside = final.with_name(f"{final.name}.replaced-{k}")
            os.replace(final, aside)
        os.replace(tmp, final)
        _atomic_write_text(self.path / "latest", str(step))
        return final


def load_metrics(path: str | os.PathLike) -> list[dict]:
    """A run folder's (or a ``metrics.jsonl`` file's) per-step metric dicts. A run still writing
    may have a torn last line: it is left out; damage anywhere else is refused by file and line."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a run folder: it has no metrics.jsonl")
    return [record for _, record in _read_log(file)[0]]


def summary(path: str | os.PathLike) -> str:
    """A few lines on a finished run, from its folder: the steps, the held-out scores (first,
    last, best; ``val/gold`` too where logged), the last losses and KLs, the time and where the files are."""
    path = Path(path)
    rows = load_metrics(path)
    lines = [f"run {path}: {rows[-1]['step'] if rows else 0} steps"]
    # the trained score, the hidden one beside a reward model, SFT's loss and a reward model's
    # ranking on held-out records
    for key in ("val/score", "val/gold", "val/loss", "val/accuracy", "val/margin"):
        val = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if len(val) == 1:
            lines.append(f"  {key}: {val[0][1]:.4g} (step {val[0][0]})")
        elif val:
            best = (min if key == "val/loss" else max)(val, key=lambda sv: sv[1])
            lines.append(
                f"  {key}: first {val[0][1]:.4g} (step {val[0][0]}), last {val[-1][1]:.4g} (step {val[-1][0]}), "
                f"best {best[1]:.4g} (step {best[0]})"
            )
    last = {}
    for r in rows:
        last |= {k: v for k, v in r.items() if v is not None}
    shown = (
        "sft/loss",
        "rm/loss",
        "rm/accuracy",
        "critic/score/mean",
        "actor/reward_kl_penalty",
        "actor/kl_loss",
        "actor/ppo_kl",
    )
    if found := [f"{k} {last[k]:.4g}" for k in shown if k in last]:
        lines.append("  last: " + ", ".join(found))
    seconds = sum(r.get("timing_s/step") or 0.0 for r in rows)
    if seconds:
        lines.append(f"  time in training steps: {seconds:.1f} s")
    logs = ["val_generations.jsonl"] if (path / "val_generations.jsonl").exists() else []
    folders = [p.name + "/" for p in sorted(path.iterdir()) if p.is_dir()]
    lines.append(f"  files: {', '.join(['config.json', 'metrics.jsonl', *logs, *folders])}")
    return "\n".join(lines)
