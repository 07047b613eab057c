"""How close each numeric assert of a chapter came to failing: the margin of every <, <=, >, >=
inside the notebook's ``assert`` statements, smallest first.

The chapters assert findings of seeded runs ("the run collapses", "the KL stays under half").
Float rounding differs between CPUs (an AVX-512 Intel machine and an AVX2 AMD one give different
trajectories from the same seed), so a finding asserted with a thin margin on one machine can fail
on another. This script executes a notebook with every comparison in an assert recorded (the
asserts still assert), then lists the comparisons by relative margin, |a - b| / max(|a|, |b|),
the worst over all the times an assert ran. Run it after a chapter changes or on a new machine.

Usage: REFPPO_CACHE=<dir> python benchmarks/assert_margins.py book/appA_debugging.ipynb [...]
       [--show 15]
"""

from __future__ import annotations

import argparse
import ast
import json
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}

PROBE = '''
import json as _json, operator as _op
_MARGINS, _OPS = {}, {"<": _op.lt, "<=": _op.le, ">": _op.gt, ">=": _op.ge, "other": None}


def __probe__(site, text, left, ops, rights, _plain):
    """Evaluate the comparison chain; record each ordering's relative margin (worst so far)."""
    values, result = [left, *rights], True
    for a, op, b, plain in zip(values, ops, values[1:], _plain):
        result = result and plain(a, b)
        try:
            x, y = float(a), float(b)
        except (TypeError, ValueError, RuntimeError):
            continue
        if op in ("<", "<=", ">", ">="):
            gap = (y - x) if op in ("<", "<=") else (x - y)
            rel = gap / max(abs(x), abs(y), 1e-12)
            if site not in _MARGINS or rel < _MARGINS[site]["relative"]:
                _MARGINS[site] = {"text": text, "a": x, "op": op, "b": y, "relative": rel}
    return result
'''


class _Probes(ast.NodeTransformer):
    """Inside assert tests only: each Compare becomes ``__probe__(site, text, left, ops, rights, plain)``."""

    def __init__(self, cell: int):
        self.cell, self.count = cell, 0

    def visit_Assert(self, node: ast.Assert):
        node.test = self._probe(node.test, node.lineno)
        return node

    def _probe(self, expr, line):
        if isinstance(expr, ast.BoolOp):
            expr.values = [self._probe(v, line) for v in expr.values]
            return expr
        if isinstance(expr, ast.IfExp):
            expr.body, expr.orelse = self._probe(expr.body, line), self._probe(expr.orelse, line)
            return expr
        if not isinstance(expr, ast.Compare) or not any(type(op) in OPS for op in expr.ops):
            return expr
        self.count += 1
        names = [OPS.get(type(op), "other") for op in expr.ops]
        # the operator itself, for == and friends too, so the chain's result is unchanged
        plain = ast.List([ast.Lambda(_args(), ast.Compare(ast.Name("a"), [op], [ast.Name("b")])) for op in expr.ops])
        site = f"cell {self.cell}, line {line}" + (f" #{self.count}" if self.count > 1 else "")
        return ast.Call(
            ast.Name("__probe__"),
            [
                ast.Constant(site),
                ast.Constant(ast.unparse(expr)[:110]),
                expr.left,
                ast.List([ast.Constant(n) for n in names]),
                ast.List(list(expr.comparators)),
                plain,
            ],
            [],
        )


def _args() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg("a"), ast.arg("b")], kwonlyargs=[], kw_defaults=[], defaults=[])


def instrument(source: str, cell: int) -> str:
    """A code cell's source with the comparisons of its asserts probed (unchanged if it has none)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython-only syntax: leave the cell alone
        return source
    probes = _Probes(cell)
    tree = ast.fix_missing_locations(probes.visit(tree))
    return ast.unparse(tree) if probes.count else source


def margins(path: Path, timeout: int) -> list[dict]:
    """Execute the notebook with its asserts probed; returns one row per probed comparison."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = instrument(cell.source, i)
    out = Path(tempfile.mkdtemp()) / "margins.json"
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))
    nb.cells.append(nbformat.v4.new_code_cell(f"_json.dump(_MARGINS, open({str(out)!r}, 'w'))"))
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    rows = json.loads(out.read_text())
    return sorted(({"site": k, **v} for k, v in rows.items()), key=lambda r: r["relative"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--show", type=int, default=15, help="the smallest margins to print per notebook")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    a = p.parse_args()
    for path in a.notebooks:
        rows = margins(path, a.timeout)
        print(f"{path}: {len(rows)} numeric comparisons in asserts; the {min(a.show, len(rows))} closest to failing")
        for r in rows[: a.show]:
            print(f"  {r['relative']:>8.1%}  {r['site']:<20} {r['a']:.4g} {r['op']} {r['b']:.4g}   {r['text']}")


if __name__ == "__main__":
    main()
