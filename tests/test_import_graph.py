"""The package's import graph points one way: cli -> recipes -> trainer -> engine -> planner -> parallel -> models ->
layers.

Every import in every module counts (module level, inside functions, under ``TYPE_CHECKING``): a lazy import that
points the wrong way is still a dependency the wrong way. Two rooms are held tighter than the order alone holds them:
``parallel`` (mechanisms only) sits directly above ``models`` and reads no task, Auto class or conversion (the engine
hands it the task and the loss, the caller the model factory), and only the CLI, the recipe runner and the engine
registry use the offline ``planner``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import mindformers_py

PACKAGE = Path(mindformers_py.__file__).parent

# Lowest first; a module may import its own group and the groups before it, never one after it.
ORDER = [
    "errors", "utils", "launcher", "layers", "generation", "data", "metrics", "task_registry", "models", "parallel",
    "checkpoint", "loading", "auto", "adapters", "convert", "planner", "pipelines", "engine", "trainer", "recipes",
    "cli", "__main__",
]
# Groups below ``parallel`` in ORDER that it still may not import: what a task is, the Auto classes, conversion.
NOT_FOR_PARALLEL = {"task_registry", "auto", "convert"}
# The only modules outside the planner that import it.
PLANNER_USERS = {"mindformers_py.cli", "mindformers_py.recipes.run_spec", "mindformers_py.engine.registry"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the mindformers_py modules ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mindformers_py"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("mindformers_py"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


def _group(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {t for t in _imports(path) if t in modules} for name, path in modules.items()}


def test_every_group_is_placed_in_the_order():
    groups = {_group(m) for m in _graph()} - {None}
    assert groups <= set(ORDER), f"place these in ORDER: {sorted(groups - set(ORDER))}"


def test_imports_point_one_way():
    wrong = []
    for source, targets in _graph().items():
        src = _group(source)
        if src is None:  # the package root re-exports the public API
            continue
        for target in targets:
            dst = _group(target)
            if dst is not None and ORDER.index(dst) > ORDER.index(src):
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports against the order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_between_modules():
    graph = _graph()
    cycles = []
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt == node or nxt.startswith(node + "."):  # a package importing its own submodules
                continue
            if state[nxt] == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif state[nxt] == 0:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_parallel_sits_directly_above_models():
    assert ORDER.index("parallel") == ORDER.index("models") + 1
    wrong = sorted(f"{source} -> {target}" for source, targets in _graph().items() if _group(source) == "parallel"
                   for target in targets if _group(target) in NOT_FOR_PARALLEL)
    assert not wrong, "parallel/ imports what the engine or the caller should hand it:\n" + "\n".join(wrong)


def test_only_the_cli_the_recipe_runner_and_the_engine_registry_use_the_planner():
    users = {source for source, targets in _graph().items() if _group(source) not in ("planner", None)
             and any(_group(t) == "planner" for t in targets)}
    assert users <= PLANNER_USERS, f"these import the planner: {sorted(users - PLANNER_USERS)}"


# Modules reached by name at run time instead of by import (``importlib.import_module``, a ``Deferred`` slot) are
# dependencies too. The one hook allowed against the order: the model classes' ``from_pretrained`` loads through the
# Auto classes' loader (one route for every class), which the package root puts in the models' slot. The launcher's
# fork server also names the engines', the Trainer's and the recipe runner's modules, to import them once before it
# forks workers (it calls nothing in them).
UPWARD_HOOKS = {("mindformers_py", "mindformers_py.auto"): "models.lazy_registration.CHECKPOINT_LOADER",
                ("mindformers_py.launcher.launch", "mindformers_py.engine.registry"): "FORKSERVER_PRELOAD",
                ("mindformers_py.launcher.launch", "mindformers_py.trainer.trainer"): "FORKSERVER_PRELOAD",
                ("mindformers_py.launcher.launch", "mindformers_py.recipes.runner"): "FORKSERVER_PRELOAD"}


def _named_modules(path: Path) -> set[str]:
    """The mindformers_py modules ``path`` names in string constants (``"mindformers_py.x.y"``, and
    ``__name__ + ".x"`` in the package root)."""
    tree = ast.parse(path.read_text())
    names = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith("mindformers_py.")}
    names |= {"mindformers_py" + node.right.value for node in ast.walk(tree)
              if isinstance(node, ast.BinOp) and isinstance(node.left, ast.Name) and node.left.id == "__name__"
              and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)
              and path.name == "__init__.py" and path.parent == PACKAGE}
    return names


def test_modules_named_at_run_time_point_one_way_but_the_one_loading_hook():
    wrong, hooks = [], set()
    for path in PACKAGE.rglob("*.py"):
        source = _module_name(path)
        for target in _named_modules(path):
            src, dst = _group(source), _group(target)
            if (source, target) in UPWARD_HOOKS:
                hooks.add((source, target))
            elif src is not None and dst in ORDER and ORDER.index(dst) > ORDER.index(src):
                wrong.append(f"{source} names {target}")
    assert not wrong, "modules reached by name against the order:\n" + "\n".join(sorted(wrong))
    assert hooks == set(UPWARD_HOOKS)
    from mindformers_py.models import registry

    loader = registry.checkpoint_loader()
    assert f"{loader.__module__}.{loader.__qualname__}" == "mindformers_py.auto.load_model_class"


MAX_FILES_PER_FOLDER = 16
MAX_LINES_PER_FILE = 600


def test_rooms_stay_small_enough_to_read():
    """No package folder holds more than 16 Python files directly and no module passes 600 lines: a room that
    grows past them is split into wings (``parallel/context/``, ``parallel/tensor/``, ``layers/loss/``)."""
    crowded = {str(d.relative_to(PACKAGE.parent)): n for d in [PACKAGE, *PACKAGE.rglob("*/")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_FILES_PER_FOLDER}
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES_PER_FILE}
    assert not crowded and not long, f"folders over {MAX_FILES_PER_FOLDER} files: {crowded}; files over {MAX_LINES_PER_FILE} lines: {long}"


def test_every_import_names_a_module_that_exists():
    """An import of a module of ours that does not exist (a relative import left one level short after a file
    moved into a wing) fails only when its line runs, often inside an error path: find it here instead."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    missing = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mindformers_py"):
                target = node.module
            else:
                continue
            if target not in modules:
                missing.append(f"{name}:{node.lineno} imports {target}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
