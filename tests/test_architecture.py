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
