"""``trainer.logger``: TensorBoard, wandb and MLflow each hold exactly what the run wrote to
``metrics.jsonl``, read back with the package's own reader (wandb's offline file by its record
format), and name the run and its project as the settings say."""

import json
import math
import random
import re

import pytest

from refppo.runs.cli import main
from refppo.runs.folder import RunFolder
from refppo.runs.loggers import mlflow_key
from refppo.settings.config import Config, apply_overrides, config_to_dict, flatten

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2"]
ALL = "trainer.logger=[console,file,tensorboard,wandb,mlflow]"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two PPO steps, each validated with two samples a prompt (so ``@`` metric names), logged to all."""
    root = tmp_path_factory.mktemp("loggers")
    assert (
        main(["sft", f"trainer.output_dir={root}/sft", "sft.steps=3", "sft.batch_size=8", *TINY, "data.val_size=8"])
        == 0
    )
    quick = ["trainer.total_training_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2"]
    quick += ["data.val_size=4", "trainer.progress_bar=false", "data.max_response_length=4", "trainer.test_freq=1"]
    quick += ["trainer.critic_warmup=0"]
    quick += ["rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=1.0"]
    out = root / "ppo_run"
    assert main(["ppo", f"model.path={root}/sft/model", f"trainer.output_dir={out}", *quick, ALL]) == 0
    return out


def logged(run):
    """(step, metric) -> value from metrics.jsonl, NaN for its nulls."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): math.nan if v is None else v for r in rows for k, v in r.items() if k != "step"}


def assert_same(got, want, rel=0.0):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert (math.isnan(got[key]) and math.isnan(value)) or got[key] == pytest.approx(value, rel=rel, abs=0), key


def test_the_run_logged_validation_metrics_with_at_signs(run):
    keys = {k for _, k in logged(run)}
    assert any("@" in k for k in keys) and "actor/pg_loss" in keys and "val/score" in keys


def test_tensorboard_holds_every_metric(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert_same(got, logged(run), rel=1e-6)  # TensorBoard keeps float32


def wandb_records(path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then 32 KiB blocks of chunks,
    each with a 7-byte header (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a header: the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            break
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_holds_every_metric_offline(run):
    (file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(file)
    got = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            got |= {(r.history.step.num, k): v for k, v in row.items() if not k.startswith("_")}
    assert_same(got, logged(run))
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (meta.project, meta.display_name) == ("refppo", "ppo_run")


def mlflow_client(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=(run / "mlruns").as_uri())


def test_mlflow_holds_every_metric_and_setting(run, monkeypatch):
    client = mlflow_client(run, monkeypatch)
    experiment = client.get_experiment_by_name("refppo")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "ppo_run" and found.info.status == "FINISHED"
    got = {}
    for key in found.data.metrics:
        got |= {(m.step, key): m.value for m in client.get_metric_history(found.info.run_id, key)}
    assert_same(got, {(step, mlflow_key(k)): v for (step, k), v in logged(run).items()})
    config = json.loads((run / "config.json").read_text())
    assert found.data.params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(config).items()}
    assert found.data.params["trainer.logger"] == '["console", "file", "tensorboard", "wandb", "mlflow"]'


def test_a_failed_run_ends_failed_under_its_experiment_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = apply_overrides(Config(), ["trainer.logger=[console,mlflow]", "trainer.experiment_name=named"])
    folder = RunFolder(tmp_path / "run", config)
    folder.log(1, {"x": 1.5})
    folder.close(ok=False)
    client = mlflow_client(tmp_path / "run", monkeypatch)
    (found,) = client.search_runs([client.get_experiment_by_name("refppo").experiment_id])
    assert (found.info.run_name, found.info.status, found.data.metrics) == ("named", "FAILED", {"x": 1.5})
    assert config_to_dict(config)["trainer"]["project_name"] == "refppo"


def verl_sanitize(key):
    """verl 0.9's MLflow metric-name rule, written from its code."""
    key = key.replace("@", "_at_")
    key = re.sub(r"/+", "/", key)
    return re.sub(r"[^/\w.\- :]", "_", key)


def test_mlflow_names_are_verls():
    rng = random.Random(0)
    alphabet = "ab/@.-_: #%()=+,é1"
    for _ in range(2000):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert mlflow_key(key) == verl_sanitize(key)
    assert mlflow_key("val-core/arithmetic/score/mean@4") == "val-core/arithmetic/score/mean_at_4"


def test_only_the_first_process_logs(tmp_path):
    from refppo.distributed import World

    config = apply_overrides(Config(), ["trainer.logger=[console,tensorboard]"])
    folder = RunFolder(tmp_path / "run", config, world=World(rank=1, size=2))
    folder.log(1, {"x": 1.0})
    assert folder.loggers == [] and not (tmp_path / "run").exists()
