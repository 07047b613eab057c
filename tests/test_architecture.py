"""refppo's layout (ARCHITECTURE.md): the top of the package holds the teaching core and the layer
folders, and every import runs down the layers."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "refppo"
# Bottom to top: a module may import its own layer and those before it.
LAYERS = ["guards", "core", "tasks", "algorithms", "settings", "rollout", "distributed", "accel", "training", "runs"]
CORE = {"__init__", "__main__", "functional", "advantages", "losses", "kl", "rewards", "registry"}
# The package's entry imports verl's other estimators and losses so that they register themselves,
# and `python -m refppo` runs the command line.
ALLOWED = {("refppo", "algorithms"), ("refppo.__main__", "runs")}


def layer(module: str) -> str:
    """The layer of a dotted module name inside refppo."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "core"


def imports(path: Path) -> set[str]:
    """The refppo modules a file imports (its functions' imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("refppo"):
            for alias in node.names:  # a module imported from its package, or a name from a module
                name = f"{node.module}.{alias.name}"
                path = PACKAGE.parent / name.replace(".", "/")
                found.add(name if path.is_dir() or path.with_suffix(".py").exists() else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("refppo")}
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_imports_run_down_the_layers():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for target in imports(path):
            if (source, layer(target)) not in ALLOWED and LAYERS.index(layer(target)) > LAYERS.index(layer(source)):
                upward.append(f"{source} ({layer(source)}) imports {target} ({layer(target)})")
    assert upward == []


def test_the_top_holds_the_teaching_core_and_the_layer_folders():
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert modules == CORE
    assert folders == set(LAYERS) - {"core"} and len(folders) <= 10
    for folder in folders:
        assert ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())), f"{folder} says its job"


def _resolves(dotted: str) -> bool:
    """Whether a dotted ``refppo`` name is a module, or an attribute reached from its longest module prefix."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_no_stale_module_names_remain():
    """Every ``refppo.<module>[.<name>]`` the docs, the book, the code, the tests and the
    benchmarks name exists (CHANGELOG.md keeps the names of its day)."""
    import re

    root = Path(__file__).parents[1]
    files = [root / name for name in ("README.md", "ARCHITECTURE.md", "pyproject.toml", "benchmarks/README.md")]
    for pattern in ("book/*.ipynb", "book/*.md", "refppo/**/*.py", "tests/*.py", "benchmarks/*.py"):
        files += sorted(root.glob(pattern))
    stale = set()
    for file in files:
        for match in re.finditer(r"\brefppo(?:\.[A-Za-z_][A-Za-z0-9_]*)+", file.read_text()):
            name = match.group(0)
            if "__main__" not in name and not _resolves(name):
                stale.add(f"{file.relative_to(root)}: {name}")
    assert not stale, sorted(stale)
