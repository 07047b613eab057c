"""The places ``trainer.logger`` sends a run's metrics, besides ``metrics.jsonl`` (always written):
TensorBoard event files, a Weights & Biases run and an MLflow run, each kept in the run folder
and offline unless the user points it elsewhere. verl 0.9's logger names; its ``file`` logger is
the metrics file.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from pathlib import Path
from unittest.mock import patch

from refppo.settings.config import Config, config_to_dict, flatten

# logger -> (the module it imports, the pip package that provides it)
PACKAGES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


def check_installed(names: tuple[str, ...]) -> None:
    """Raise ImportError naming the pip command for each logger in ``names`` whose package is
    missing (called before the run folder is made)."""
    for name in names:
        if name in PACKAGES:
            module, package = PACKAGES[name]
            try:
                importlib.import_module(module)
            except ImportError:
                needs = f"trainer.logger=[{','.join(names)}] needs the {package} package"
                raise ImportError(f"{needs}: pip install {package}") from None


def open_loggers(config: Config, folder: Path) -> list:
    """The loggers ``config.trainer.logger`` names, writing into the run folder ``folder`` (the
    console and the metrics file are the run folder's own)."""
    kinds = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}
    return [kinds[name](config, folder) for name in config.trainer.logger if name in kinds]


def run_name(config: Config, folder: Path) -> str:
    """``trainer.experiment_name``, or the run folder's name when it is null."""
    return config.trainer.experiment_name or folder.resolve().name


class TensorBoardLogger:
    """Event files under ``<run>/tensorboard``."""

    def __init__(self, config: Config, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One scalar per metric at ``step``, flushed."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, ok: bool = True) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbLogger:
    """A wandb run in ``<run>/wandb``: project ``trainer.project_name``, name :func:`run_name`,
    the config as its config. Offline (``wandb sync <run>/wandb/offline-run-*`` uploads it) unless
    ``WANDB_MODE`` says otherwise; wandb's console capture and system statistics are off."""

    def __init__(self, config: Config, folder: Path):
        import wandb

        self.run = wandb.init(
            project=config.trainer.project_name,
            name=run_name(config, folder),
            dir=str(folder),
            config=config_to_dict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            reinit="create_new",  # a second run in one process (tests, notebooks) is its own
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics as one history row at ``step``."""
        self.run.log(metrics, step=step)

    def close(self, ok: bool = True) -> None:
        """Finish the run (exit code 1 for a run that failed)."""
        self.run.finish(exit_code=0 if ok else 1)


_MLFLOW_INVALID = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric name as verl's MLflow logger writes it: ``@`` as ``_at_``, repeated slashes as one,
    and any other character MLflow refuses as ``_`` (``val-core/x/score/mean@4`` ->
    ``val-core/x/score/mean_at_4``)."""
    return _MLFLOW_INVALID.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


class MlflowLogger:
    """An MLflow run in experiment ``trainer.project_name``, named :func:`run_name`, with every
    setting as a parameter (spelled as in ``config.json``). Its store is ``MLFLOW_TRACKING_URI``
    when set, else a file store in ``<run>/mlruns`` (``mlflow ui --backend-store-uri <run>/mlruns``
    shows it)."""

    def __init__(self, config: Config, folder: Path):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        # MLflow 3 asks to opt in to its file store
        with patch.dict(os.environ, {} if uri else {"MLFLOW_ALLOW_FILE_STORE": "true"}):
            self.client = MlflowClient(tracking_uri=uri or (folder.resolve() / "mlruns").as_uri())
        project = config.trainer.project_name
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name(config, folder)).info.run_id
        flat = flatten(config_to_dict(config)).items()  # each value as config.json spells it
        params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in flat]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics at ``step``, named by :func:`mlflow_key`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self, ok: bool = True) -> None:
        """End the run as FINISHED, or FAILED for a run that failed."""
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
