"""Record verl's Python files and the functions and classes each defines, for the book's citations.

For every ``verl/**.py`` of a verl checkout (a git tag) this writes the names a citation may give:
its top-level functions and classes, and each class's methods as ``Class.method``. The result,
``verl_0_9_0_symbols.json`` ({path: [names]}), is what ``tests/test_book_structure.py`` checks the
book's verl citations against (a cited path must be a file of verl 0.9.0, a cited name one it
defines), so the test needs no verl checkout. Nothing of verl is imported or run: the files are
parsed with ``ast``.

Usage (from the project root, with a verl checkout, e.g. the snapshot ``fetch`` brings)::

    python tests/data/record_verl_symbols.py /path/to/verl.git v0.9.0
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("verl_0_9_0_symbols.json")


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "-C", git_dir, *args], capture_output=True, text=True, check=True).stdout


def names(source: str) -> list[str]:
    """The top-level functions and classes of a module, and its classes' methods as Class.method."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node.name)
        elif isinstance(node, ast.ClassDef):
            found.append(node.name)
            found += [
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
    return sorted(set(found))


def record(git_dir: str, tag: str) -> dict[str, list[str]]:
    listed = git(git_dir, "ls-tree", "-r", "--name-only", tag, "--", "verl").split()
    paths = sorted(p for p in listed if p.endswith(".py"))
    return {path: names(git(git_dir, "show", f"{tag}:{path}")) for path in paths}


if __name__ == "__main__":
    git_dir, tag = sys.argv[1:3]
    recorded = record(git_dir, tag)
    OUT.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
    print(f"{OUT}: {sum(map(len, recorded.values()))} names in {len(recorded)} files")
