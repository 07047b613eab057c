"""The README's Python examples run as printed, and print the numbers their comments give."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"

# Runs every block in its own namespace with ``print`` recorded (a subprocess: the blocks
# register functions in refppo's global registries).
RUNNER = r"""
import json, sys, torch
printed = []
for source in json.load(sys.stdin):
    out = []
    def record(*args):
        out.append([torch.as_tensor(a, dtype=torch.float64).flatten().tolist() for a in args])
    exec(compile(source, "README.md", "exec"), {"print": record, "__name__": "readme"})
    printed.append(out)
json.dump(printed, sys.stdout)
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def expected_prints(block: str) -> list[str]:
    """The comment after each ``print(...)`` line of a block, in order ('' where none)."""
    lines = [line for line in block.splitlines() if line.startswith("print(")]
    return [line.partition("#")[2].strip() for line in lines]


def check_printed(values: list[float], comment: str) -> None:
    """The comment's numbers before its first ':' (or, where none, after it) are the values
    printed; '~x' gives an order of magnitude."""
    claim, _, rest = comment.partition(":")
    if claim.strip().startswith("~"):
        bound = float(claim.strip()[1:])
        assert all(abs(v) <= 10 * bound for v in values), f"printed {values}, README says {comment!r}"
        return
    numbers = [float(x) for x in re.findall(NUMBER, claim) or re.findall(NUMBER, rest)]
    assert numbers, f"no number in the comment {comment!r}"
    assert values == pytest.approx(numbers, abs=1e-5), f"printed {values}, README says {comment!r}"


@pytest.fixture(scope="module")
def readme_run():
    blocks = python_blocks(README.read_text())
    out = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=README.parent,
        timeout=600,
    )
    assert out.returncode == 0, f"a README example failed:\n{out.stderr[-3000:]}"
    return blocks, json.loads(out.stdout)


def test_every_python_example_runs(readme_run):
    blocks, printed = readme_run
    assert len(blocks) >= 4 and len(printed) == len(blocks)


def test_examples_print_what_the_readme_says(readme_run):
    blocks, printed = readme_run
    checked = 0
    for block, out in zip(blocks, printed):
        comments = expected_prints(block)
        assert len(out) == len(comments), f"{len(out)} prints for {len(comments)} print lines in:\n{block}"
        for (values,), comment in zip(out, comments):
            if comment:
                check_printed(values, comment)
                checked += 1
    assert checked >= 3


@pytest.mark.parametrize(
    ("values", "comment"),
    [([0.5, 0.5], "raw advantages: [0.5, 0.6]"), ([-0.5], "-0.6: why"), ([2e-5], "~1e-7: why"), ([1.0], "no number")],
)
def test_a_wrong_printed_value_is_caught(values, comment):
    with pytest.raises(AssertionError):
        check_printed(values, comment)
