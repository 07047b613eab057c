"""Several runs' metrics side by side: the chapters' learning curves and ``refppo plot``.

A run is its list of per-step metric dicts (what :func:`refppo.training.fit.fit` returns, or a run
folder's ``metrics.jsonl`` read by :func:`refppo.runs.folder.load_metrics`). Runs that differ only by
seed form a group: its curve is the mean over the seeds at the x values every seed logged,
with a band from the lowest to the highest seed.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from refppo.runs.folder import load_metrics

History = list[dict]
XS = ("step", "time")  # time: seconds spent in training steps so far (sum of timing_s/step)


def _points(history: History, key: str, x: str, smooth: int) -> tuple[list[int], list[float], list[float]]:
    """The steps that logged ``key``, their x values and the (smoothed) values: one pass."""
    if x not in XS:
        raise ValueError(f"x must be one of {XS}, got {x!r}")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    steps = []
    xs = []
    ys = []
    clock = 0.0
    for row in history:
        clock += row.get("timing_s/step") or 0.0
        if row.get(key) is not None:
            steps.append(row["step"])
            xs.append(row["step"] if x == "step" else clock)
            ys.append(row[key])
    windows = [ys[max(0, i - smooth + 1) : i + 1] for i in range(len(ys))]
    return steps, xs, [sum(w) / len(w) for w in windows]


def series(history: History, key: str, x: str = "step", smooth: int = 1) -> tuple[list[float], list[float]]:
    """The (x, y) points of one metric in one run, at the steps that logged it.

    Args:
        history: per-step metric dicts, each with "step".
        key: the metric, e.g. "val/score".
        x: "step", or "time" (cumulative ``timing_s/step``, so runs are compared by wall time).
        smooth: a trailing moving average over this many logged points (1: none).

    Returns:
        xs, ys: equal-length lists (empty when the run never logged ``key``).
    """
    return _points(history, key, x, smooth)[1:]


def group_curve(histories: Sequence[History], key: str, x: str = "step", smooth: int = 1):
    """Mean, lowest and highest of a metric over runs that differ only by seed.

    With x="step" the runs are aligned at the steps all of them logged; with x="time" each run's
    own clock differs, so the mean clock at those steps is the x.

    Returns:
        xs, mean, low, high: equal-length lists.
    """
    if not histories:
        raise ValueError("group_curve needs at least one run")
    per_run = []
    for h in histories:
        steps, xs, ys = _points(h, key, x, smooth)
        per_run.append(dict(zip(steps, zip(xs, ys))))
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    xs = [sum(r[s][0] for r in per_run) / len(per_run) for s in steps]
    ys = [[r[s][1] for r in per_run] for s in steps]
    return xs, [sum(v) / len(v) for v in ys], [min(v) for v in ys], [max(v) for v in ys]


def _as_histories(run) -> list[History]:
    """A run (history or folder) or a list of them -> a list of histories."""
    if isinstance(run, (str, os.PathLike)):
        return [load_metrics(run)]
    if run and isinstance(run[0], dict):
        return [run]
    return [load_metrics(r) if isinstance(r, (str, os.PathLike)) else r for r in run]


def check_keys(runs: Mapping[str, list[History]], keys: Sequence[str]) -> None:
    """Refuse a metric that a run never logged, naming the closest ones it did."""
    for name, histories in runs.items():
        for h in histories:
            logged = {k for row in h for k, v in row.items() if v is not None}
            for key in keys:
                if key not in logged:
                    close = difflib.get_close_matches(key, sorted(logged), n=4, cutoff=0.4)
                    hint = (
                        f"; closest: {', '.join(close)}" if close else f"; it logged: {', '.join(sorted(logged)[:12])}"
                    )
                    raise ValueError(f"run {name!r} never logged {key!r}{hint}")


def plot_runs(
    runs: Mapping,
    keys: Sequence[str],
    x: str = "step",
    smooth: int = 1,
    titles: Mapping[str, str] | None = None,
    ncols: int = 3,
):
    """One panel per metric, one curve per run (or per group of seeds, with its min-max band).

    Args:
        runs: label -> a history, a run folder, or a list of either (seeds of one setting).
        keys: the metrics to plot, one panel each.
        x: "step" or "time" (seconds in training steps).
        smooth: trailing moving average over this many logged points.
        titles: key -> panel title (default: the key).
        ncols: panels per row.

    Returns:
        The matplotlib Figure.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or refppo[book])") from None
    if not keys:
        raise ValueError("name at least one metric to plot")
    groups = {name: _as_histories(run) for name, run in runs.items()}
    check_keys(groups, keys)
    ncols = min(ncols, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, histories in groups.items():
            xs, mean, low, high = group_curve(histories, key, x, smooth)
            (line,) = ax.plot(xs, mean, label=name if len(histories) == 1 else f"{name} ({len(histories)} seeds)")
            if len(histories) > 1:
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title((titles or {}).get(key, key), fontsize=10)
        ax.set_xlabel("step" if x == "step" else "seconds in training steps")
        ax.set_ylabel(key, fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _check_image_path(out: str) -> None:
    """Refuse an image path matplotlib cannot write: an unknown format, or a missing folder."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(out).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"-o {out}: unknown image format {suffix!r}; use one of {', '.join(sorted(formats))}")
    folder = Path(out).parent
    if not folder.is_dir():
        raise ValueError(f"-o {out}: no folder {folder}; create it first")


def run_plot(argv: list[str]) -> int:
    """``refppo plot RUN [RUN ...] -m METRIC [-m ...] -o FILE``: runs' metrics side by side."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="refppo plot",
        description="Plot metrics of several run folders side by side, one panel per metric. "
        "A run is PATH or LABEL=PATH[,PATH...] (several paths: seeds of one setting, drawn as their mean "
        "with a min-max band).",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN")
    parser.add_argument(
        "-m", "--metric", action="append", required=True, help="a metric key, e.g. val/score (repeat for more panels)"
    )
    parser.add_argument("-o", "--out", required=True, help="the image to write (.png, .pdf, .svg)")
    parser.add_argument("--x", choices=XS, default="step", help="step, or seconds spent in training steps")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over this many logged points")
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, paths = spec.partition("=")
        folders = paths.split(",") if sep else [spec]
        name = label if sep else Path(spec).name or spec
        if name in runs:  # a second line under one label would hide the first
            raise ValueError(f"two runs are labelled {name!r} ({','.join(runs[name])} and {','.join(folders)}): "
                             "name each LABEL=PATH, or give seeds of one setting as LABEL=PATH,PATH")  # fmt: skip
        runs[name] = folders
    if os.path.exists(args.out) and not args.force:
        raise ValueError(f"{args.out} exists; pass --force to replace it")
    if os.path.isdir(args.out):
        raise ValueError(f"{args.out} is a folder; give the image file to write")
    _check_image_path(args.out)
    fig = plot_runs(runs, args.metric, x=args.x, smooth=args.smooth)  # every check before the write
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
