"""The planted-bug harness stays runnable: each bug's line is in its file exactly once, so an edit
to the package that moves a line fails here at once, not only when the (slow) harness next runs."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("plant_trainer_bugs", ROOT / "tests" / "plant_trainer_bugs.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


@pytest.mark.parametrize("file, name, old, new", harness.BUGS, ids=[bug[1] for bug in harness.BUGS])
def test_each_planted_line_is_in_its_file_once(file, name, old, new):
    text = (ROOT / "refppo" / file).read_text()
    assert text.count(old) == 1, f"{name!r}: its line is in refppo/{file} {text.count(old)} times; update BUGS"
    assert old != new, f"{name!r} plants nothing"


def test_bug_names_are_distinct():
    names = [bug[1] for bug in harness.BUGS]
    assert len(names) == len(set(names))
