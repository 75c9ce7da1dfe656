"""The package's shape, checked: layers that point down, no import cycles, small modules,
short functions.

Read from the source with ast (nothing is imported), so the check is fast and names
the module or function that breaks a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# A longer function says why in its docstring, in a sentence starting with this.
LENGTH_REASON = "Long because"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((SRC / "fourbit").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fourbit modules ``name`` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from package import module` depends on the module; on the package only
            # for names that are not modules of it.
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


# src/fourbit's packages and top-level modules from the ground up: a module may import
# from its own layer or one below, never from one above (STYLE.md 23). Within a layer the
# cycle check keeps the arrows one way.
LAYERS = (
    # utilities that know nothing of models
    {"atomic", "cpuinfo", "envcheck", "filesystems", "hashing", "layouts", "metrics", "progress",
     "records", "schema", "threads", "usercache", "versions"},
    # the numerics: grids and GPTQ, the CPU kernels, the on-disk formats
    {"quant", "kernels", "formats"},
    # checkpoints on disk
    {"checkpoints"},
    # what is built from checkpoints: the model walk, the vLLM plugin, the inputs, llama.cpp's
    # tools, the bench's measurement guards, the task sets and their sandbox
    {"quantizers", "vllm_plugin", "inputs", "llamacpp", "bench", "tasks"},
    # engines run checkpoints, servers serve them; the report reads records
    {"engines", "report", "serving"},
    # the study: the validated config and its ids, and the disk its outputs take, read by the
    # workflow at DAG time
    {"config", "diskspace"},
    # one module per rule file
    {"steps"},
)


def _layer(module: str) -> int:
    """The layer of ``fourbit.<part>...`` (the package itself is its __init__)."""
    part = module.split(".")[1] if "." in module else ""
    for rank, members in enumerate(LAYERS):
        if part in members:
            return rank
    raise AssertionError(f"{module}: its package {part!r} is in no layer of LAYERS; add it")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, as "importer -> imported"."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for target in targets if _layer(target) > _layer(module))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_layers_point_down():
    modules = {name: path for name, path in _modules().items() if name != "fourbit"}
    graph = {name: _imports(name, path, modules) - {"fourbit"} for name, path in modules.items()}
    assert _upward(graph) == [], "imports that run from a lower layer to a higher one"


def test_the_layer_check_finds_an_upward_import():
    graph = {"fourbit.quant.grid": {"fourbit.steps.quantize"}, "fourbit.steps.quantize": {"fourbit.quant.grid"}}
    assert _upward(graph) == ["fourbit.quant.grid -> fourbit.steps.quantize"]


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_the_limit():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: split them by job"


def test_long_functions_say_why():
    unexplained = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and LENGTH_REASON not in (ast.get_docstring(node) or ""):
                    unexplained.append(f"{name}.{node.name} ({length} lines)")
    assert unexplained == [], (f"functions over {MAX_FUNCTION_LINES} lines without "
                               f"'{LENGTH_REASON} ...' in their docstring")
