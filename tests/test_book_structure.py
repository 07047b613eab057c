"""The book's reading rules, checked on the notebooks' sources (nothing is executed):

- no markdown cell over 350 words, so prose comes in readable pieces;
- every exercise has one hint, then a solution, both folded (``:class: dropdown``), and every code
  cell of a solution is folded too (tagged ``hide-cell`` or ``hide-input``); a learner's check cell
  (untagged) comes before the folded solution code;
- every chapter links the notation page;
- a write-it-yourself exercise (its title ends "yourself)") is not answered before the exercises:
  the code a reader sees before them (code cells and literalincluded source) neither defines its
  solution's functions, nor the function its statement checks against ("against `name`"), nor
  repeats a run of its solution's code (as tokens, with every variable renamed);
- every chapter (a notebook named ch* or app*) reads in one sitting: at most 4,000 words of prose and
  450 visible code lines (issue 65; the definitions are in ``chapter_size``'s docstring).
"""

import ast
import io
import json
import keyword
import re
import tokenize
from pathlib import Path

import pytest

BOOK = Path(__file__).parents[1] / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
CHAPTERS = [p for p in NOTEBOOKS if re.match(r"(ch\d|app)", p.name)]
MAX_WORDS = 350
FOLDED_TAGS = {"hide-cell", "hide-input"}
WRITE_IT_YOURSELF = re.compile(r"\*\*Exercise (\d+) \([^*]*?yourself\)\.\*\*")
# Tokens in a row that the solution may share with the code shown before the exercises: the
# chapters' solutions share at most 12 with it (a loop header, a call); the code they asked for
# shared 19 (chapter 8's best-of-n weights) and 42 (chapter 6's k3) before issue 65.
SHARED_RUN = 15
MAX_CHAPTER_WORDS = 4000
MAX_VISIBLE_CODE_LINES = 450
HIDDEN_CODE_TAGS = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
CODE_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def words(markdown: str) -> int:
    """Words a reader reads: HTML comments (the coverage markers) are not shown."""
    return len(re.sub(r"<!--.*?-->", "", markdown, flags=re.S).split())


def prose(markdown: str) -> str:
    """Markdown without its fenced code blocks: a fence with no info string, a language name, or a
    directive that shows code (``{code-block}``, ``{code}``, ``{code-cell}``, ``{literalinclude}``).
    Other directives (admonitions, figures' captions, math) are kept: a reader reads them."""
    kept, fence, directives = [], None, []  # the open code fence; the open directives' fences
    for line in markdown.splitlines():
        m = CODE_FENCE.match(line.strip())
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            continue
        info = m.group(2).strip() if m else ""
        if m and not info and directives and m.group(1) == directives[-1]:
            directives.pop()  # a directive's closing fence
        elif m and info.startswith("{") and not re.match(r"\{(code-block|code-cell|code|literalinclude)\}", info):
            directives.append(m.group(1))
        elif m:
            fence = m.group(1)
            continue
        kept.append(line)
    return "\n".join(kept)


def chapter_size(nb_cells: list[dict]) -> tuple[int, int]:
    """(prose words, visible code lines) of a chapter.

    Prose words: ``words`` of the markdown cells' ``prose``, i.e. markdown outside fenced code
    blocks, HTML comments not counted. Visible code lines: the lines of the code cells that are not
    tagged hide-input, hide-cell, remove-input or remove-cell, blank lines included (folded code is
    one click away; the reader does not read it in passing)."""
    prose_words = code_lines = 0
    for cell in nb_cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            prose_words += words(prose(source))
        elif cell["cell_type"] == "code" and not HIDDEN_CODE_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            code_lines += len(source.splitlines())
    return prose_words, code_lines


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


def literalinclude_text(directive: str, base: Path = BOOK) -> str:
    """The source a ```{literalinclude}``` block shows: its file, cut to its :pyobject: (with the
    decorators), then by :start-at: / :start-after: and :end-at: / :end-before:."""
    head, *lines = directive.strip().splitlines()
    options = dict(re.match(r":([\w-]+):\s*(.*)", line).groups() for line in lines if re.match(r":[\w-]+:", line))
    options = {key: value.strip().strip("'\"") for key, value in options.items()}
    text = (base / head.split("}", 1)[1].strip()).read_text()
    shown = text.splitlines(keepends=True)
    if "pyobject" in options:
        nodes = ast.parse(text).body
        for part in options["pyobject"].split("."):
            node = next(n for n in nodes if getattr(n, "name", None) == part)
            nodes = node.body
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        shown = shown[first - 1 : node.end_lineno]
    for key, after in (("start-at", 0), ("start-after", 1)):
        if key in options:
            shown = shown[next(i for i, line in enumerate(shown) if options[key] in line) + after :]
    for key, at in (("end-at", 1), ("end-before", 0)):
        if key in options:
            shown = shown[: next(i for i, line in enumerate(shown) if options[key] in line) + at]
    return "".join(shown)


def shown_before_exercises(nb_cells: list[dict], base: Path = BOOK) -> list[str]:
    """The code a reader sees before the exercises: each code cell, and each literalincluded piece."""
    pieces = []
    for cell in nb_cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            if re.search(r"^## Exercises", source, re.M):
                break
            includes = re.findall(r"```\{literalinclude\}[^\n]*\n(?::[^\n]*\n)*", source)
            pieces += [literalinclude_text(block, base) for block in includes]
        elif cell["cell_type"] == "code":
            pieces.append(source)
    return pieces


def write_it_yourself(nb_cells: list[dict]) -> list[tuple[str, dict[str, str], str | None]]:
    """Each write-it-yourself exercise: its number, the functions its folded solution code defines
    ({name: the function's code}), and the function its statement checks against, if it names one."""
    found, current = [], None
    for cell in nb_cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            if re.search(r"\*\*Exercise \d+", source):
                current = None
            title = WRITE_IT_YOURSELF.search(source)
            if title:
                statement = source[title.start() :].split("```{admonition}")[0]
                reference = re.search(r"against\s+`([\w.]+)", statement)
                current = (title.group(1), {}, reference and reference.group(1).rsplit(".", 1)[-1])
                found.append(current)
        elif current and FOLDED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef):
                    current[1][node.name] = ast.get_source_segment(source, node)
    return found


def tokens(code: str) -> list[str]:
    """Python tokens with every variable's name as "_" (attribute names and keywords kept) and every
    string as "S", comments and layout dropped: the same code under other names gives the same list."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    out = []
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type in skip:
            continue
        word = token.string
        if token.type == tokenize.NAME and not keyword.iskeyword(word) and out[-1:] != ["."]:
            word = "_"
        elif token.type == tokenize.STRING:
            word = "S"
        out.append(word)
    return out


def longest_shared_run(a: list[str], b: list[str]) -> int:
    """The length of the longest run of tokens that a and b both contain."""
    best, previous = 0, [0] * (len(b) + 1)
    for x in a:
        current = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            if x == y:
                current[j + 1] = previous[j] + 1
                best = max(best, current[j + 1])
        previous = current
    return best


def spoiled_exercises(nb_cells: list[dict], base: Path = BOOK) -> list[str]:
    """What a reader sees before the exercises that a write-it-yourself exercise asks them to write."""
    problems, shown = [], None
    for number, functions, reference in write_it_yourself(nb_cells):
        shown = shown if shown is not None else shown_before_exercises(nb_cells, base)
        names = {reference} if reference else set()
        for name, code in functions.items():
            names |= {name, name.removeprefix("my_")}
            body = tokens(code)[tokens(code).index(":") + 1 :]  # without the def line
            run = max((longest_shared_run(body, tokens(piece)) for piece in shown), default=0)
            if run >= SHARED_RUN:
                problems.append(f"exercise {number}: {run} tokens of {name} are shown before the exercises")
        for name in sorted(names):
            if any(re.search(rf"\bdef {re.escape(name)}\(", piece) for piece in shown):
                problems.append(f"exercise {number}: def {name}( is shown before the exercises")
        if not functions:
            problems.append(f"exercise {number}: its folded solution defines no function")
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
def test_write_it_yourself_exercises_are_not_answered_before(path):
    assert spoiled_exercises(cells(path)) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_reads_in_one_sitting(path):
    """At most 4,000 words of prose (markdown outside fenced code blocks, HTML comments not counted)
    and 450 visible code lines (code cells not tagged hide-input, hide-cell, remove-input or
    remove-cell; blank lines included): see ``chapter_size``."""
    prose_words, code_lines = chapter_size(cells(path))
    assert prose_words <= MAX_CHAPTER_WORDS, f"{path.name}: {prose_words} words of prose"
    assert code_lines <= MAX_VISIBLE_CODE_LINES, f"{path.name}: {code_lines} visible code lines"


def open_solutions(nb_cells: list[dict]) -> list[int]:
    """The worked solutions (a Solution admonition's markdown, a folded code cell) of the
    exercises section that JupyterLab would show open: those without ``jupyter.source_hidden``."""
    out = []
    started = False
    for i, cell in enumerate(nb_cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and re.search(r"^## Exercises", source, re.M):
            started = True
        solution = (cell["cell_type"] == "markdown" and re.search(r"^```\{admonition\} Solution", source, re.M)) or (
            cell["cell_type"] == "code" and "hide-cell" in cell.get("metadata", {}).get("tags", [])
        )
        if started and solution and not cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
            out.append(i)
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_worked_solutions_start_collapsed_in_jupyterlab(path):
    """The HTML folds each solution; JupyterLab and Notebook 7 collapse a cell whose metadata has
    ``jupyter.source_hidden``, so a notebook reader meets every solution closed too."""
    assert open_solutions(cells(path)) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapters_link_the_notation_page(path):
    assert "<notation>" in path.read_text()


def test_the_collapse_rule_catches_an_open_solution():
    exercises = {"cell_type": "markdown", "source": ["## Exercises\n"]}
    solution = {
        "cell_type": "markdown",
        "source": ["```{admonition} Solution\n:class: dropdown\nx\n```"],
        "metadata": {},
    }
    code = {"cell_type": "code", "source": ["x = 1"], "metadata": {"tags": ["hide-cell"]}}
    assert open_solutions([exercises, solution, code]) == [1, 2]
    closed = {"jupyter": {"source_hidden": True}}
    assert (
        open_solutions([exercises, solution | {"metadata": closed}, code | {"metadata": closed | code["metadata"]}])
        == []
    )


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
    fenced = "a b\n```python\nx = 1\n```\n```{literalinclude} f.py\n:pyobject: g\n```\n"
    directive = "```{admonition} Hint\n:class: dropdown\nc d\n```\n"
    assert prose(fenced + directive) == "a b\n" + directive.rstrip("\n")  # the admonition is read
    code = {"cell_type": "code", "source": "x = 1\n\ny = 2\n", "metadata": {}}
    folded = {**code, "metadata": {"tags": ["hide-input"]}}
    assert chapter_size([code, folded, {"cell_type": "markdown", "source": fenced}]) == (2, 3)


def test_the_spoiler_rule_catches_what_it_names(tmp_path):
    def cell(kind, source, tags=()):
        return {"cell_type": kind, "source": source, "metadata": {"tags": list(tags)}}

    solution = (
        "def my_sq(x):\n    total = 0\n    for value in x:\n"
        "        total = total + value * value * 2 + value - 1\n    return total\n"
    )
    statement = "**Exercise 4 (write it yourself).** Write `my_sq`; checked against `pkg.sq`.\n"
    exercise = [
        cell("markdown", "## Exercises\n\n" + statement),
        cell("markdown", "```{admonition} Hint\n:class: dropdown\nLoop.\n```\n"),
        cell("code", solution + "check(my_sq)\n", ["hide-cell"]),
    ]
    assert write_it_yourself(exercise) == [("4", {"my_sq": solution.strip()}, "sq")]
    assert spoiled_exercises([cell("code", "x = 1\n"), *exercise]) == []
    # the same code under other names: the whole body (all but the def line's six tokens) is shared
    renamed = solution.replace("my_sq", "helper").replace("total", "acc").replace("value", "v")
    assert spoiled_exercises([cell("code", renamed), *exercise]) == [
        f"exercise 4: {len(tokens(solution)) - 6} tokens of my_sq are shown before the exercises"
    ]
    assert spoiled_exercises([cell("code", "def sq(x):\n    return 0\n"), *exercise]) == [
        "exercise 4: def sq( is shown before the exercises"
    ]
    (tmp_path / "pkg.py").write_text("import math\n\n\n@cache\ndef sq(x):\n    return x\n\n\ndef other():\n    pass\n")
    include = "```{literalinclude} pkg.py\n:pyobject: sq\n```\n"
    assert literalinclude_text(include, tmp_path) == "@cache\ndef sq(x):\n    return x\n"
    cut = "```{literalinclude} pkg.py\n:start-at: import\n:end-before: '@cache'\n```\n"
    assert literalinclude_text(cut, tmp_path) == "import math\n\n\n"
    assert spoiled_exercises([cell("markdown", include), *exercise], tmp_path) == [
        "exercise 4: def sq( is shown before the exercises"
    ]
    assert spoiled_exercises([cell("markdown", cut), *exercise], tmp_path) == []
