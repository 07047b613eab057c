"""The book's reading rules, checked on the notebooks' sources (nothing is executed):

- no markdown cell over 350 words, so prose comes in readable pieces;
- every exercise has one hint, then a solution, both folded (``:class: dropdown``), and every code
  cell of a solution is folded too (tagged ``hide-cell`` or ``hide-input``); a learner's check cell
  (untagged) comes before the folded solution code;
- every chapter links the notation page.
"""

import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).parents[1] / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
CHAPTERS = [p for p in NOTEBOOKS if re.match(r"(ch\d|app)", p.name)]
MAX_WORDS = 350
FOLDED_TAGS = {"hide-cell", "hide-input"}


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def words(markdown: str) -> int:
    """Words a reader reads: HTML comments (the coverage markers) are not shown."""
    return len(re.sub(r"<!--.*?-->", "", markdown, flags=re.S).split())


def exercise_events(nb_cells: list[dict]) -> list[tuple[str, str]]:
    """The exercises section as a sequence of (kind, detail), in reading order:
    ("exercise", its number), ("hint" | "solution", the admonition's options),
    ("code", "folded" | "open")."""
    events, started = [], False
    for cell in nb_cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            started = started or re.search(r"^## Exercises", source, re.M) is not None
            if not started:
                continue
            pattern = r"\*\*Exercise (\d+)|```\{admonition\} (Hint|Solution)\n((?::[^\n]*\n)*)"
            for m in re.finditer(pattern, source):
                if m.group(1):
                    events.append(("exercise", m.group(1)))
                else:
                    events.append((m.group(2).lower(), m.group(3)))
        elif started and cell["cell_type"] == "code":
            tags = set(cell.get("metadata", {}).get("tags", []))
            events.append(("code", "folded" if tags & FOLDED_TAGS else "open"))
    return events


def exercise_problems(events: list[tuple[str, str]]) -> list[str]:
    """What breaks the rules above, one line per problem."""
    problems, exercises = [], []
    for kind, detail in events:
        if kind == "exercise":
            exercises.append((detail, []))
        elif exercises:
            exercises[-1][1].append((kind, detail))
        else:
            problems.append(f"a {kind} before the first exercise")
    for number, items in exercises:
        kinds = [k for k, _ in items]
        name = f"exercise {number}"
        if kinds.count("hint") != 1:
            problems.append(f"{name}: {kinds.count('hint')} hints")
            continue
        if "solution" not in kinds:
            problems.append(f"{name}: no solution")
            continue
        hint = kinds.index("hint")
        if kinds.index("solution") < hint:
            problems.append(f"{name}: the solution comes before the hint")
        for kind, options in items:
            if kind in ("hint", "solution") and ":class: dropdown" not in options:
                problems.append(f"{name}: its {kind} is not folded")
        code = [(i, d) for i, (k, d) in enumerate(items) if k == "code"]
        if any(i < hint for i, _ in code):
            problems.append(f"{name}: code before the hint")
        folded = [i for i, d in code if d == "folded"]
        if any(d == "open" and folded and i > folded[0] for i, d in code):
            problems.append(f"{name}: open code after the folded solution")
        if not folded and kinds.index("solution") > hint + 1 and any(d == "open" for _, d in code):
            problems.append(f"{name}: its solution code is not folded")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_markdown_cell_is_a_wall(path):
    long = [(i, words("".join(c["source"]))) for i, c in enumerate(cells(path)) if c["cell_type"] == "markdown"]
    assert [(i, n) for i, n in long if n > MAX_WORDS] == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_exercises_have_a_folded_hint_then_a_folded_solution(path):
    events = exercise_events(cells(path))
    assert any(kind == "exercise" for kind, _ in events), f"{path.name} has no exercises"
    assert exercise_problems(events) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapters_link_the_notation_page(path):
    assert "<notation>" in path.read_text()


def test_the_rules_catch_what_they_name():
    ok = [("exercise", "1"), ("hint", ":class: dropdown\n"), ("code", "folded"), ("solution", ":class: dropdown\n")]
    assert exercise_problems(ok) == []
    with_check = ok[:2] + [("code", "open")] + ok[2:]
    assert exercise_problems(with_check) == []
    assert exercise_problems([ok[0], ok[3], ok[1]]) == ["exercise 1: the solution comes before the hint"]
    assert exercise_problems(ok[:1] + ok[2:]) == ["exercise 1: 0 hints"]
    assert exercise_problems(ok[:3]) == ["exercise 1: no solution"]
    unfolded = ok[:3] + [("solution", "")]
    assert exercise_problems(unfolded) == ["exercise 1: its solution is not folded"]
    assert exercise_problems(ok[:2] + [("code", "open")] + ok[3:]) == ["exercise 1: its solution code is not folded"]
    late_check = ok[:3] + [("code", "open")] + ok[3:]
    assert exercise_problems(late_check) == ["exercise 1: open code after the folded solution"]
    spoiler = [ok[0], ("code", "folded"), *ok[1:]]
    assert exercise_problems(spoiler) == ["exercise 1: code before the hint"]
    assert words("a b <!-- c d e --> f") == 3
