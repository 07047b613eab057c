"""The chapters run once: nbval executes each one under pytest, and every chapter whose cells all
ran without an error is stored, with the outputs nbval collected, in the jupyter-cache that the
book's build reads (``_build/.jupyter_cache``, Jupyter Book's default). ``jupyter-book build .``
after ``pytest`` then finds each chapter there and executes none again; a chapter that changed
since (its code cells hash differently) or failed is executed by the build as before.

Only a whole, clean run is stored: a chapter with a failed, skipped or unselected cell is not.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

BOOK_CACHE = Path(__file__).resolve().parent.parent / "_build" / ".jupyter_cache"

# notebook path -> {"nb": the notebook nbval read, "outputs": {code cell number: outputs},
# "clean": no cell failed or was skipped, "seconds": the cells' run time}
_RUNS: dict[Path, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not hasattr(item, "test_outputs") or report.when != "call":
        return
    run = _RUNS.setdefault(Path(item.parent.path), {"nb": item.parent.nb, "outputs": {}, "clean": True, "seconds": 0.0})
    run["seconds"] += call.duration
    if report.passed:
        run["outputs"][item.cell_num] = item.test_outputs
    else:
        run["clean"] = False


def executed_notebook(nb: nbformat.NotebookNode, outputs: dict[int, list]) -> nbformat.NotebookNode | None:
    """A copy of ``nb`` with each code cell's outputs and execution count as a run from the top
    made them, or None unless ``outputs`` holds every code cell's."""
    executed = copy.deepcopy(nb)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    if sorted(outputs) != list(range(len(code))):
        return None
    for number, cell in enumerate(code):
        cell.outputs = [nbformat.from_dict(output) for output in outputs[number]]
        cell.execution_count = number + 1
    return executed


def store(path: Path, nb: nbformat.NotebookNode, seconds: float, cache_folder: Path = BOOK_CACHE) -> None:
    """Put an executed notebook in the jupyter-cache at ``cache_folder`` as Jupyter Book would."""
    from filelock import FileLock
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache_folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_folder) + ".lock"):  # pytest-xdist's workers write one at a time
        bundle = CacheBundleIn(nb, str(path), data={"execution_seconds": seconds})
        get_cache(str(cache_folder)).cache_notebook_bundle(bundle, check_validity=False, overwrite=True)


def pytest_sessionfinish(session):
    for path, run in _RUNS.items():
        executed = executed_notebook(run["nb"], run["outputs"]) if run["clean"] else None
        if executed is not None:
            store(path, executed, run["seconds"])
