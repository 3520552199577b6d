"""The package's imports run one way (STYLE.md): no module pair, or longer loop, imports each other, counting
imports inside functions; `validate`'s plan describes a recipe without importing the training package."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "erniekit_lite"


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (top level or inside functions)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from erniekit_lite.train import run` imports the module erniekit_lite.train.run
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name and m != "erniekit_lite"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_checker_sees_a_loop_and_function_level_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]] and reachable(graph, "d") == {"a", "b", "c"}
    built = import_graph()
    assert "erniekit_lite.model.load" in built["erniekit_lite.plan"]  # imported inside plan()'s body only
    assert "erniekit_lite.train.run" in built["erniekit_lite.train.sft"]  # `from erniekit_lite.train import run`


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_plan_never_imports_training():
    graph = import_graph()
    for plan in ("erniekit_lite.plan", "erniekit_lite.run_plan"):
        assert not {m for m in reachable(graph, plan) if m.startswith("erniekit_lite.train.")}
    assert "erniekit_lite.run_plan" in reachable(graph, "erniekit_lite.train.sft")  # training executes the run plan


def test_training_takes_the_recipe_only_until_the_run_plan_is_built():
    """Under train/ a `Recipe` parameter is taken only by what comes before the run plan (run_plan.py): the methods'
    entries (`run`, KTO's choice of its data), the Trainer arguments, the run dir's target; the trainers, the
    model's set-up, the callbacks and the step take the plan."""
    import ast

    takes = set()
    for path in sorted((ROOT / "erniekit_lite" / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.annotation is not None and "Recipe" in ast.unparse(arg.annotation):
                        takes.add(f"{path.stem}.{node.name}")
    entries = {f"{m}.run" for m in ("dpo", "grpo", "kto", "pt", "reference_free", "rm", "run", "sft")}
    assert takes == entries | {"kto.method", "kto.with_kl", "common.run_arguments", "rundir.target", "rundir._identity"}


def test_the_model_modules_take_the_plan_not_the_recipe():
    """Under model/ nothing imports the recipe module but for a section's type (lora.py: LoraSection); the run plan
    (run_plan.py) is what `train` hands on."""
    import ast

    for path in sorted((ROOT / "erniekit_lite" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "erniekit_lite.recipe":
                assert {a.name for a in node.names} <= {"LoraSection", "mutates_base"}, path.name
            assert not (isinstance(node, ast.Name) and node.id == "Recipe"), f"{path.name}:{node.lineno}"


def test_only_the_cli_command_imports_the_web_ui():
    """The web UI (erniekit_lite.webui) sits on the package: outside it only cli.py's `webui` command imports it."""
    graph = import_graph()
    assert "erniekit_lite.webui.train_tab" in reachable(graph, "erniekit_lite.webui.app")  # the checker sees it
    importers = {m for m, imported in graph.items() if not m.startswith("erniekit_lite.webui")
                 and any(i.startswith("erniekit_lite.webui") for i in imported)}
    assert importers == {"erniekit_lite.cli"}


def test_validate_runs_without_loading_the_training_package(tmp_path, tiny_dense_dir):
    """The same, as Python sees it: a whole `validate` plan in a fresh interpreter leaves no training module loaded."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(tiny_dense_dir)}, "lora": {"r": 4},
                                      "data": {"train": [str(ROOT / "recipes" / "data" / "identity.jsonl")]},
                                      "output": {"dir": str(tmp_path / "out")}}))
    code = ("import json, sys\nfrom erniekit_lite import plan, recipe\n"
            f"info = plan.plan(recipe.load({str(recipe)!r}, []), log=lambda *a: None)\n"
            "print(json.dumps([info['train_samples'], sorted(m for m in sys.modules if m.startswith('erniekit_lite.train')\n"
            "                                                  and m != 'erniekit_lite.trainer_args')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    samples, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert samples > 0 and loaded == []
