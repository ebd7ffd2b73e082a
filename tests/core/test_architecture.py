"""The shape of the code, checked from its source: imports go one way with no circle, nothing hides one behind an
import inside a function or under ``TYPE_CHECKING``, the cache's options are read where the cache lives, and the
architecture page draws the packages that exist."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.cache.spec import CacheOptions

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kvlab"
#: What the cache's options answer besides their own values: asking one of these is looking at an option too.
DERIVED = {"tiered", "freezes", "demotes", "global_scope", "pools_heads", "measures_layers", "capturable", "noisy"}
#: The places outside ``kvlab/cache/`` that may look at an option: the engine's plan, the claims reading stored runs'
#: options, and the live page drawing the allocation its widgets chose.
OPTION_READERS = {"kvlab/engine/plan.py", "kvlab/claims/options.py", "views/live.py"}
#: A function-level or ``TYPE_CHECKING`` import of a kvlab module is allowed only where a command must start without
#: torch, with a comment on the line saying so.
LATE_IMPORTS_ALLOWED = "kvlab/cli/"


def modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text(encoding="utf-8"))


def imported(node: ast.AST, package: set[str]) -> list[str]:
    """The kvlab modules an import statement names: ``from kvlab.a import b`` names ``kvlab.a.b`` where that is a
    module, else ``kvlab.a`` (as import-linter reads it: a package's own ``__init__`` importing its modules is not a
    circle)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("kvlab")]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvlab"):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
        return [name if name in package else node.module for name in names]
    return []


def late_imports(tree: ast.Module) -> Iterator[ast.stmt]:
    """Imports inside functions and under ``if TYPE_CHECKING``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from (sub for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom)))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (sub for sub in node.body if isinstance(sub, (ast.Import, ast.ImportFrom)))


def test_the_imports_of_every_module_form_no_circle():
    """Every import counts, at the top of a module, inside a function or under TYPE_CHECKING."""
    found = list(modules())
    names = {name for name, _, _ in found}
    graph = {name: set() for name in names}
    for name, _, tree in found:
        for node in ast.walk(tree):
            graph[name] |= {target for target in imported(node, names) if target in names and target != name}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join([*trail[trail.index(target) :], target]))
            if target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_kvlab_import_hides_inside_a_function_except_where_a_command_must_start_without_torch():
    names = {name for name, _, _ in modules()}
    for _, path, tree in modules():
        lines = path.read_text(encoding="utf-8").splitlines()
        relative = path.relative_to(REPO).as_posix()
        for node in late_imports(tree):
            if not imported(node, names):
                continue
            where = f"{relative}:{node.lineno}"
            assert relative.startswith(LATE_IMPORTS_ALLOWED), (
                f"a kvlab import inside a function or TYPE_CHECKING: {where}"
            )
            said = lines[node.end_lineno - 1] + lines[node.lineno - 1]
            guard = next((line for line in lines if "if TYPE_CHECKING" in line), "")
            assert "torch" in said or "torch" in guard, f"{where} does not say why it is imported late"


def _named(node: ast.expr) -> str:
    """The last name of ``a.b.c`` or ``c``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def option_reads(tree: ast.Module) -> Iterator[int]:
    """Lines that read a cache option: an option's name (or a question the options answer) asked of something named
    ``options``, or an option's name as a key of a parameter mapping (``params``, ``stored``)."""
    options = set(CacheOptions.names())
    mappings = {"params", "stored", "policy_params", "options"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in options | DERIVED and _named(node.value) == "options":
            yield node.lineno
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in options:
            if _named(node.value) in mappings:
                yield node.lineno
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in options:
                if _named(node.func.value) in mappings:
                    yield node.lineno


def test_the_cache_options_are_read_in_the_cache_and_three_named_places():
    readers: dict[str, list[int]] = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "views").glob("*.py"), REPO / "app.py"]):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("kvlab/cache/"):
            continue
        lines = sorted(set(option_reads(ast.parse(path.read_text(encoding="utf-8")))))
        if lines:
            readers[relative] = lines
    assert set(readers) <= OPTION_READERS, {
        name: lines for name, lines in readers.items() if name not in OPTION_READERS
    }
    assert len(OPTION_READERS) <= 3


def test_the_architecture_page_draws_every_package_and_module_at_the_top():
    """The picture in docs/ARCHITECTURE.md names each folder of kvlab and each module at its top, and nothing else."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    picture = re.search(r"```text\n(.*?)```", text, re.S)
    assert picture is not None, "the architecture page has a picture in a ```text block"
    drawn = set(re.findall(r"\b([a-z_]+)/", picture.group(1))) | set(re.findall(r"\b([a-z_]+)\.py\b", picture.group(1)))
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file() and path.name != "data"}
    top = {path.stem for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__")}
    assert drawn == packages | top
