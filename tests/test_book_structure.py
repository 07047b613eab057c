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
  450 visible code lines (issue 65; the definitions are in ``chapter_size``'s docstring);
- every sentence of the book that says what verl does names its source in verl 0.9, a file and a
  function or class it defines, checked against ``tests/data/verl_0_9_0_symbols.json`` (issue 65;
  ``verl_claims`` says what counts as such a sentence and as its source).
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
# verl 0.9.0's files and the functions and classes each defines (Class.method too), recorded from a verl
# checkout by tests/data/record_verl_symbols.py: the book's verl citations are checked against it.
VERL_SYMBOLS = json.loads((Path(__file__).parent / "data" / "verl_0_9_0_symbols.json").read_text())
# A source footnote's definition is a reference and nothing else: the verl file, then the names it defines.
VERL_PATH = r"`verl/[\w/]+\.py`"
SOURCE_FOOTNOTE = re.compile(
    rf"^\[\^([\w-]+)\]: verl 0\.9: {VERL_PATH}(?:, `[\w.]+`)+(?:; {VERL_PATH}(?:, `[\w.]+`)+)*\.$", re.M
)
# Sentences that name verl without saying what it does (the book's sources, a reader's task, the
# appendix's own behaviour): (file, a piece of the sentence). Each must still match a sentence.
NOT_VERL_CLAIMS = [
    ("appB2_departures.ipynb", "Appendix B reads each of verl's settings"),  # the page's scope
    ("appB2_departures.ipynb", "This page lists the few places"),  # the page's scope
    ("appB2_departures.ipynb", "In each, verl's number moves with"),  # the page's scope, sourced below
    ("appA_debugging.ipynb", "say what each of verl's step metrics measures"),  # a learning goal
    ("ch04_gae.ipynb", "including verl's rule for masked positions"),  # a learning goal
    ("ch05_rlhf_loop.ipynb", "map verl's seven stages and its configuration keys"),  # a learning goal
    ("ch05_rlhf_loop.ipynb", "takes verl 0.9's keys as they"),  # refppo's reading of verl's keys
    ("ch05_rlhf_loop.ipynb", "a setting of verl's cluster is taken with a warning"),  # refppo's behaviour
    ("ch05_rlhf_loop.ipynb", "A whole verl command line starts from verl's defaults"),  # refppo's behaviour
    ("ch05b_reading_a_run.ipynb", "whether verl's initialisation does better, is exercise 2"),  # a pointer
    ("ch07_ppo_vs_grpo.ipynb", "A verl name that refppo lacks is refused by name"),  # refppo's behaviour
    ("intro.md", "frameworks such as verl"),  # the book's scope
    ("intro.md", "a walk through verl's PPO source"),  # the notes the book follows
    ("intro.md", "verl's stages and keys"),  # the table of chapters
    ("appB_verl_keys.ipynb", "carries over to verl 0.9 formula for formula"),  # the chapters cite each formula
    ("appB_verl_keys.ipynb", "that verl also has takes verl's name"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "**verl's engine.**"),  # a list item's title
    ("appB_verl_keys.ipynb", "only says how verl places, shards, serves"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "A verl setting that would change the numbers"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "**verl's defaults for a verl line.**"),  # a list item's title
    ("appB_verl_keys.ipynb", "spells some setting as only verl does"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "prints the verl command line of a"),  # refppo's behaviour (twice)
    ("appB_verl_keys.ipynb", "against verl 0.9.0's own generated trainer configuration"),  # tests' recorded keys
    ("appB_verl_keys.ipynb", "(its `docs/start/quickstart.rst`)"),  # sourced to verl's docs file
    ("appB_verl_keys.ipynb", "left as verl's"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "concern verl's engine and cluster"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "from a verl command line it is dropped"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "and verl's GRPO example, on a tiny model"),  # the tests' runs
    ("appB_verl_keys.ipynb", "the settings verl shares with the same default"),  # the tables, from refppo's code
    ("appB_verl_keys.ipynb", "In verl's column"),  # the tables' notation
    ("appB_verl_keys.ipynb", "as verl's interpolations (`${...}`) do"),  # verl's YAML, in the recorded trainer keys
    ("appB_verl_keys.ipynb", "a few choices verl makes elsewhere"),  # the tables, from refppo's code
    ("appB_verl_keys.ipynb", "which a verl command line takes from verl"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "unless given the value that turns it off (verl's default)"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "renamed to verl's name"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "key families of verl's engine"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "What verl has no counterpart for"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "ships shell scripts under `examples/`"),  # the recorded examples
    ("appB_verl_keys.ipynb", "reads a verl line, and run a step"),  # the tests
    ("appB_verl_keys.ipynb", "noted as a setting of verl's engine"),  # refppo's behaviour
    ("appB_verl_keys.ipynb", "settled where `refppo` read a verl setting"),  # the list's items cite
    ("appB_verl_keys.ipynb", "`+key` refuses a key verl's configuration has"),  # Hydra's grammar
    ("appB_verl_keys.ipynb", "(what a verl line changes)"),  # an exercise
    ("appB_verl_keys.ipynb", "append one setting in verl's spelling"),  # an exercise
    ("appB_verl_keys.ipynb", "A line with a setting of verl's engine in it"),  # a hint
    ("appB_verl_keys.ipynb", "makes it a verl command line"),  # refppo's rule
    ("appB_verl_keys.ipynb", "a researcher pasting a verl command line"),  # refppo's rule
    ("appB_verl_keys.ipynb", "To run a verl line on the book's tiny models"),  # refppo's rule
]


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
    blocks, HTML comments not counted, nor the definitions of verl source footnotes
    (``SOURCE_FOOTNOTE``: a file path and function names, e.g. ``[^gae]: verl 0.9:
    `verl/trainer/ppo/core_algos.py`, `compute_gae_advantage_return`.``), which a reader looks up
    rather than reads; their markers in the text (``[^gae]``) add no word. Visible code lines: the
    lines of the code cells that are not tagged hide-input, hide-cell, remove-input or remove-cell,
    blank lines included (folded code is one click away; the reader does not read it in passing)."""
    prose_words = code_lines = 0
    for cell in nb_cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            prose_words += words(SOURCE_FOOTNOTE.sub("", prose(source)))
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


BOOK_PAGES = NOTEBOOKS + sorted(BOOK.glob("*.md"))
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?]\*\*)\s+|(?<=[.!?]\))\s+")


def page_markdown(path: Path) -> list[str]:
    """A page's markdown: its markdown cells, or the whole file."""
    if path.suffix == ".md":
        return [path.read_text()]
    return ["".join(c["source"]) for c in cells(path) if c["cell_type"] == "markdown"]


def sentences(markdown: str) -> list[str]:
    """The sentences of markdown's prose, each on one line: headings, labels (``(name)=``), directive
    fences and options, HTML comments and footnote definitions left out; a list item and a table row
    start a new sentence."""
    text = re.sub(r"<!--.*?-->", "", prose(markdown), flags=re.S)
    out, paragraph = [], []

    def close():
        joined = " ".join(paragraph).strip()
        out.extend(s for s in SENTENCE_END.split(joined) if s.strip())
        paragraph.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or re.match(r"(#|\(.*\)=$|\[\^[\w-]+\]:|:[\w-]+:|`{3,}|~{3,})", stripped):
            close()
        elif re.match(r"([-*] |\d+\. |\|)", stripped):
            close()
            paragraph.append(stripped)
        else:
            paragraph.append(stripped)
    close()
    return out


def names_verl(sentence: str) -> bool:
    """Whether a sentence names verl in its words: not only inside code (a ``verl/...`` path, a key) or
    a role's target."""
    words_only = re.sub(r"\{\w+\}`[^`]*`|`[^`]*`|\]\([^)]*\)", "", sentence)
    return re.search(r"\bverl\b", words_only) is not None


def cites_verl(text: str) -> bool:
    """Whether text names a file of verl 0.9 and, in code, a function or class that file defines."""
    code = set(re.findall(r"`([\w.]+)`", text))
    return any(code & set(VERL_SYMBOLS.get(path, [])) for path in re.findall(r"`(verl/[\w/]+\.py)`", text))


def source_problems(markdown: str) -> list[str]:
    """What is wrong with the verl source footnotes of a page: each definition's file must be one of
    verl 0.9's and each name one that file defines."""
    problems = []
    for m in SOURCE_FOOTNOTE.finditer(markdown):
        for part in m.group(0).split(": ", 1)[1].split("; "):
            path, *names = re.findall(r"`([^`]+)`", part)
            if path not in VERL_SYMBOLS:
                problems.append(f"[^{m.group(1)}]: {path} is not a file of verl 0.9")
            known = VERL_SYMBOLS.get(path, [])
            problems += [f"[^{m.group(1)}]: {path} defines no {n}" for n in names if n not in known]
    return problems


def verl_claims(pages: dict[str, list[str]], exempt: list[tuple[str, str]]) -> list[str]:
    """The sentences that say what verl does and name no source for it, and what else is wrong with the
    sources, one line each. A sentence says what verl does when it names verl in its words (see
    ``names_verl``) and is not exempt (``NOT_VERL_CLAIMS``). It names its source inline (a ``verl/...py``
    path and, in code, a function or class the file defines: ``cites_verl``) or by a footnote
    (``[^name]``) whose definition on the same page is a ``SOURCE_FOOTNOTE``."""
    problems, used = [], set()
    for page, markdowns in pages.items():
        whole = "\n".join(markdowns)
        sources = {m.group(1): m.group(0) for m in SOURCE_FOOTNOTE.finditer(whole)}
        problems += [f"{page}: {p}" for p in source_problems(whole)]
        for markdown in markdowns:
            for sentence in sentences(markdown):
                if not names_verl(sentence):
                    continue
                hits = [piece for name, piece in exempt if name == page and piece in sentence]
                if hits:
                    used.update((page, piece) for piece in hits)
                    continue
                notes = re.findall(r"\[\^([\w-]+)\]", sentence)
                if not (cites_verl(sentence) or any(n in sources for n in notes)):
                    problems.append(f"{page}: no verl source: {sentence[:160]}")
    problems += [f"{page}: exempts no sentence: {piece}" for page, piece in exempt if (page, piece) not in used]
    return problems


def test_every_verl_claim_names_its_source_in_verl():
    pages = {path.name: page_markdown(path) for path in BOOK_PAGES}
    assert verl_claims(pages, NOT_VERL_CLAIMS) == []


def test_the_verl_claim_rule_catches_what_it_names():
    source = "[^vanilla]: verl 0.9: `verl/trainer/ppo/core_algos.py`, `compute_policy_loss_vanilla`.\n"
    cited = "verl clamps the log-ratio to 20[^vanilla].\n\n" + source
    assert verl_claims({"p": [cited]}, []) == []
    inline = "verl whitens with `masked_whiten` (`verl/utils/torch_functional.py`).\n"
    assert verl_claims({"p": [inline]}, []) == []
    bare = "## verl's loop\n\nThe clip is 0.2 in `verl/x.py`. verl clamps the log-ratio to 20.\n"
    assert verl_claims({"p": [bare]}, []) == ["p: no verl source: verl clamps the log-ratio to 20."]
    assert verl_claims({"p": [bare]}, [("p", "clamps the log")]) == []
    assert verl_claims({"p": ["No claim."]}, [("p", "clamps")]) == ["p: exempts no sentence: clamps"]
    wrong = cited.replace("compute_policy_loss_vanilla", "compute_policy_loss_plain")
    assert verl_claims({"p": [wrong]}, []) == [
        "p: [^vanilla]: verl/trainer/ppo/core_algos.py defines no compute_policy_loss_plain"
    ]
    assert sentences("- a verl b. c\n- d\n\n| x | verl |\n") == ["- a verl b.", "c", "- d", "| x | verl |"]
    assert chapter_size([{"cell_type": "markdown", "source": cited}]) == (6, 0)  # the definition is not read


# Issue 65: every item of the notes' checklist (the seeds' CHECKLIST.md, which a clone does not
# have: its IDs are copied here) is asserted, with the ID cited in a code cell that asserts, in each
# chapter named below.
CHECKLIST_ASSERTED = {
    "000.1": ["ch05_rlhf_loop"],
    "000.2": ["ch06_dual_kl"],
    "000.3": ["ch05_rlhf_loop"],
    "001.1": ["ch02_ppo_penalty"],
    "001.2": ["ch02_ppo_penalty"],
    "001.3": ["ch02_ppo_penalty"],
    "001.4": ["ch02_ppo_penalty"],
    "002.1": ["ch05_rlhf_loop"],
    "002.2": ["ch05_rlhf_loop"],
    "002.3": ["ch05_rlhf_loop"],
    "002.4": ["ch05_rlhf_loop"],
    "002.5": ["ch05_rlhf_loop"],
    "002.6": ["ch04_gae", "ch05_rlhf_loop"],
    "002.7": ["ch05_rlhf_loop"],
    "003.1": ["ch01_rl_basics"],
    "003.2": ["ch01_rl_basics"],
    "003.3": ["ch01_rl_basics"],
    "003.4": ["ch05_rlhf_loop"],
    "003.5": ["ch05_rlhf_loop"],
    "003.6": ["ch05_rlhf_loop"],
    "003.7": ["ch05_rlhf_loop"],
    "003.8": ["ch03_ppo_clip", "ch04_gae", "ch05_rlhf_loop"],
    "003.9": ["ch05_rlhf_loop"],
    "003.10": ["ch02_ppo_penalty", "ch03_ppo_clip", "ch04_gae", "ch05_rlhf_loop", "ch06_dual_kl", "ch07_ppo_vs_grpo"],
    "003.11": ["ch02_ppo_penalty"],
    "003.12": ["ch01_rl_basics", "ch04_gae"],
    "003.13": ["ch02_ppo_penalty"],
    "003.14": ["ch02_ppo_penalty"],
    "003.15": ["ch03_ppo_clip"],
    "003.16": ["ch04_gae"],
    "004.1": ["ch03_ppo_clip"],
    "004.2": ["ch07_ppo_vs_grpo"],
    "004.3": ["ch04_gae"],
    "004.4": ["ch04_gae"],
    "004.5": ["ch03_ppo_clip"],
    "004.6": ["ch05_rlhf_loop"],
    "004.7": ["ch06b_policy_modes"],
    "004.8": ["ch05_rlhf_loop"],
    "004.9": ["ch05_rlhf_loop"],
    "004.10": ["ch06_dual_kl"],
    "004.11": ["ch06b_policy_modes"],
    "004.12": ["ch06_dual_kl"],
    "004.13": ["ch03_ppo_clip", "appA_debugging"],
    "004.14": ["ch04_gae", "appA_debugging", "appA2_debugging_tools"],
    "X1": ["ch05_rlhf_loop"],
    "X2": ["ch05_rlhf_loop"],
    "X3": ["ch04_gae"],
    "X4": ["ch03_ppo_clip"],
    "X5": ["ch06_dual_kl"],
    "X6": ["ch06_dual_kl"],
    "X7": ["ch05_rlhf_loop"],
    "X8": ["ch02_ppo_penalty"],
    "X9": ["ch05_rlhf_loop"],
}
CHECKLIST_IDS = (
    "000.1 000.2 000.3 001.1 001.2 001.3 001.4 002.1 002.2 002.3 002.4 002.5 002.6 002.7 "
    "003.1 003.2 003.3 003.4 003.5 003.6 003.7 003.8 003.9 003.10 003.11 003.12 003.13 003.14 "
    "003.15 003.16 004.1 004.2 004.3 004.4 004.5 004.6 004.7 004.8 004.9 004.10 004.11 004.12 "
    "004.13 004.14 X1 X2 X3 X4 X5 X6 X7 X8 X9"
).split()


def cites(source: str, item: str) -> bool:
    """Whether source names checklist item ``item`` (003.1 is not 003.10, X1 not X10)."""
    return re.search(rf"(?<![\d.]){re.escape(item)}(?!\d)", source) is not None


def asserting_cells(nb_cells: list[dict]) -> list[str]:
    """The sources of the code cells that assert something."""
    sources = ["".join(c["source"]) for c in nb_cells if c["cell_type"] == "code"]
    return [s for s in sources if re.search(r"\bassert", s)]


def test_every_checklist_item_is_asserted_where_the_map_says():
    assert len(CHECKLIST_IDS) == 53 and sorted(CHECKLIST_ASSERTED) == sorted(CHECKLIST_IDS)
    unasserted = [
        (item, stem)
        for item, stems in CHECKLIST_ASSERTED.items()
        for stem in stems
        if not any(cites(s, item) for s in asserting_cells(cells(BOOK / f"{stem}.ipynb")))
    ]
    assert unasserted == []


def test_the_checklist_rule_catches_what_it_names():
    assert cites("# CHECKLIST 003.10 X1", "003.10") and not cites("# CHECKLIST 003.10", "003.1")
    assert not cites("X10", "X1") and not cites("1003.1", "003.1") and cites("(003.1)", "003.1")
    code = {"cell_type": "code", "source": ["# 003.1\n", "x = 1\n"]}
    checked = {"cell_type": "code", "source": ["# 003.1\n", "assert x == 1\n"]}
    prose_only = {"cell_type": "markdown", "source": ["003.1, assert"]}
    assert asserting_cells([code, prose_only]) == [] and asserting_cells([checked]) == ["# 003.1\nassert x == 1\n"]
