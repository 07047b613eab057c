"""Several runs side by side: load_metrics, series, group_curve, plot_runs and ``refppo plot``."""

import json
import random

import matplotlib
import pytest

from refppo.runs.cli import main
from refppo.runs.folder import load_metrics
from refppo.runs.plots import group_curve, plot_runs, series

matplotlib.use("Agg")


def _history(seed, steps=12, every=3):
    """A fake run: score every step, val/score every ``every`` steps and at step 0."""
    rng = random.Random(seed)
    rows = [{"step": 0, "val/score": rng.random()}]
    for s in range(1, steps + 1):
        row = {"step": s, "critic/score/mean": rng.random(), "timing_s/step": 0.1 + rng.random()}
        if s % every == 0:
            row["val/score"] = rng.random()
        rows.append(row)
    return rows


def _folder(tmp_path, name, history):
    path = tmp_path / name
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    return path


def test_series_smooths_and_accumulates_time_like_a_plain_loop():
    h = _history(0)
    xs, ys = series(h, "critic/score/mean", smooth=3)
    raw = [r["critic/score/mean"] for r in h if "critic/score/mean" in r]
    assert xs == list(range(1, 13))
    assert ys == pytest.approx([sum(raw[max(0, i - 2) : i + 1]) / len(raw[max(0, i - 2) : i + 1]) for i in range(12)])
    ts, vs = series(h, "val/score", x="time")
    clock, expected = 0.0, []
    for r in h:
        clock += r.get("timing_s/step", 0.0)
        if "val/score" in r:
            expected.append(clock)
    assert ts == pytest.approx(expected) and len(vs) == 5
    with pytest.raises(ValueError, match="x must be one of"):
        series(h, "val/score", x="wall")


def test_group_curve_is_the_mean_min_and_max_at_the_steps_every_seed_logged():
    runs = [_history(1), _history(2), _history(3, steps=9)]  # the third stops at step 9
    xs, mean, low, high = group_curve(runs, "val/score")
    assert xs == [0, 3, 6, 9]
    for i, step in enumerate(xs):
        values = [r["val/score"] for h in runs for r in h if r["step"] == step]
        assert mean[i] == pytest.approx(sum(values) / 3) and low[i] == min(values) and high[i] == max(values)


def test_plot_runs_draws_one_curve_per_group_and_names_unknown_metrics(tmp_path):
    seeds = [_folder(tmp_path, f"s{i}", _history(i)) for i in range(3)]
    fig = plot_runs({"grpo": seeds, "ppo": _history(9)}, ["val/score", "critic/score/mean"])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["grpo (3 seeds)", "ppo"]
    assert list(ax.lines[0].get_ydata()) == pytest.approx(group_curve([load_metrics(p) for p in seeds], "val/score")[1])
    assert len(ax.collections) == 1, "a min-max band for the group of seeds only"
    with pytest.raises(ValueError, match="never logged 'val/scor'; closest: val/score"):
        plot_runs({"ppo": _history(9)}, ["val/scor"])


def test_load_metrics_drops_a_torn_last_line_and_refuses_other_damage(tmp_path):
    path = _folder(tmp_path, "r", _history(0))
    log = path / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 13, "val')
    assert [r["step"] for r in load_metrics(path)] == list(range(13))
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "{oops", *lines[1:]]))
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON line"):
        load_metrics(path)
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        load_metrics(tmp_path / "missing")


def test_cli_plot_writes_an_image_and_never_replaces_one_unasked(tmp_path, capsys):
    a, b, c = (_folder(tmp_path, n, _history(i)) for i, n in enumerate("abc"))
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), f"seeds={b},{c}", "-m", "val/score", "-m", "critic/score/mean", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    with pytest.raises(ValueError, match="exists; pass --force"):
        main(["plot", str(a), "-m", "val/score", "-o", str(out)])
    with pytest.raises(ValueError, match="never logged"):
        main(["plot", str(a), "-m", "no/such", "-o", str(tmp_path / "new.png"), "--force"])
    assert out.read_bytes() == before and not (tmp_path / "new.png").exists()
    assert main(["plot", str(a), "-m", "val/score", "-o", str(out), "--force", "--x", "time"]) == 0
    assert out.read_bytes() != before


def test_cli_plot_refuses_an_image_path_it_cannot_write(tmp_path):
    a = _folder(tmp_path, "a", _history(0))
    with pytest.raises(ValueError, match=r"-o .*out.xyz: unknown image format 'xyz'; use one of .*png"):
        main(["plot", str(a), "-m", "val/score", "-o", str(tmp_path / "out.xyz")])
    with pytest.raises(ValueError, match=r"-o .*missing/dir/x.png: no folder .*missing/dir; create it first"):
        main(["plot", str(a), "-m", "val/score", "-o", str(tmp_path / "missing" / "dir" / "x.png")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    (tmp_path / "shot.png").mkdir()
    with pytest.raises(ValueError, match=r"shot.png is a folder; give the image file"):
        main(["plot", str(a), "-m", "val/score", "-o", str(tmp_path / "shot.png"), "--force"])


def test_cli_plot_refuses_two_runs_under_one_label(tmp_path):
    """Two run folders named alike (e1/ppo and e2/ppo), or one label given twice: the second line
    would replace the first in the legend and the plot, so the plot is refused before it is drawn."""
    (tmp_path / "e1").mkdir()
    (tmp_path / "e2").mkdir()
    first = _folder(tmp_path / "e1", "ppo", _history(0))
    second = _folder(tmp_path / "e2", "ppo", _history(1))
    out = tmp_path / "same.png"
    with pytest.raises(ValueError, match=r"two runs are labelled 'ppo'"):
        main(["plot", str(first), str(second), "-m", "val/score", "-o", str(out)])
    with pytest.raises(ValueError, match=r"two runs are labelled 'a'"):
        main(["plot", f"a={first}", f"a={second}", "-m", "val/score", "-o", str(out)])
    assert not out.exists()
    assert main(["plot", f"one={first}", f"two={second}", "-m", "val/score", "-o", str(out)]) == 0
