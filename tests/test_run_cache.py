from pathlib import Path

import pytest
from test_cli import TINY

from refppo.runs import run_cache


def test_cached_run_trains_once_per_setting(tmp_path, monkeypatch):
    calls = []
    real_main = run_cache.main
    monkeypatch.setattr(run_cache, "main", lambda argv: calls.append(argv) or real_main(argv))
    args = ["sft.steps=2", "sft.batch_size=4", *TINY]
    first = run_cache.cached_run("sft", args, tmp_path)
    assert (first / "model" / "config.json").exists() and len(calls) == 1
    assert run_cache.cached_run("sft", args, tmp_path) == first and len(calls) == 1  # reused, not retrained
    other = run_cache.cached_run("sft", [*args, "sft.lr=5e-4"], tmp_path)
    assert other != first and len(calls) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left

    def killed_midway(argv):  # an interrupted run leaves a partial folder behind
        out = Path(next(a for a in argv if a.startswith("trainer.output_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cache, "main", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        run_cache.cached_run("sft", [*args, "sft.lr=1e-4"], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted([first.name, other.name])
    monkeypatch.setattr(run_cache, "main", real_main)
    retried = run_cache.cached_run("sft", [*args, "sft.lr=1e-4"], tmp_path)  # the partial run is not reused
    assert (retried / "model" / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(ValueError, match="unknown command 'eval'"):
        run_cache.cached_run("eval", [], tmp_path)


def test_a_changed_data_file_runs_again(tmp_path):
    """The same settings over a data file whose contents changed are another run."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "completion": "{i + 1}"}}\n' for i in range(8)))
    args = ["data.task=file", f"data.train_files={data}", "sft.steps=1", "sft.batch_size=2", *TINY]
    first = run_cache.cached_run("sft", args, tmp_path / "cache")
    assert run_cache.cached_run("sft", args, tmp_path / "cache") == first
    data.write_text(data.read_text().replace('"2"', '"3"'))
    assert run_cache.cached_run("sft", args, tmp_path / "cache") != first


def test_the_source_digest_reads_the_whole_package(monkeypatch):
    """A change anywhere in refppo (the trainer, the settings, a formula) makes a cached run stale,
    not only a change beside the cache in refppo/runs/."""
    import refppo

    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    run_cache._source_digest()
    package = Path(refppo.__file__).parent
    parts = {path.relative_to(package).parts[0] for path in read}
    assert {"advantages.py", "training", "settings", "rollout", "runs"} <= parts, parts
