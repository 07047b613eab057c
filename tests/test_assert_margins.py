"""benchmarks/assert_margins.py: probed asserts keep their meaning and record their margins."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from assert_margins import PROBE, instrument  # noqa: E402


def run(source: str) -> dict:
    scope: dict = {}
    exec(PROBE, scope)
    exec(instrument(source, cell=3), scope)
    return scope["_MARGINS"]


def test_margins_are_recorded_worst_first_and_asserts_still_hold():
    margins = run(
        "x, y = 0.9, 1.0\n"
        "for k in (1.0, 2.0):\n"
        "    assert k * x < y + 1.5, 'in a loop'\n"  # worst run: 1.8 < 2.5
        "assert 0 < x <= y and x != y\n"
        "assert (y > 2) if False else abs(x - y) < 0.5\n"
    )
    loop = margins["cell 3, line 3"]
    assert (loop["a"], loop["op"], loop["b"]) == (1.8, "<", 2.5)
    assert loop["relative"] == pytest.approx(0.7 / 2.5)
    chain = margins["cell 3, line 4 #2"]  # the chain records its tighter link: 0.9 <= 1.0
    assert (chain["a"], chain["b"]) == (0.9, 1.0) and chain["relative"] == pytest.approx(0.1)
    assert margins["cell 3, line 5 #4"]["b"] == 0.5  # the branch that ran


@pytest.mark.parametrize(
    "source",
    [
        "assert 2 < 1",
        "assert 0 < 2 < 1",
        "assert 1 < 2 and 3 > 4",
        "assert 1 < 2 == 3",
        "assert (1 < 0) if True else 1",
    ],
)
def test_a_false_assert_still_fails(source):
    with pytest.raises(AssertionError):
        run(source)


def test_a_cell_without_asserts_or_in_ipython_syntax_is_left_alone():
    assert instrument("x = 1 < 2\n", 0) == "x = 1 < 2\n"
    assert instrument("%timeit 1 < 2\nassert 1 < 2\n", 0) == "%timeit 1 < 2\nassert 1 < 2\n"
