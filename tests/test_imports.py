"""The house's dependencies run one way, and one framework's package never imports the other.

The order (docs/design.md): `torch_reference` at the ground (no other package of the project),
`jax_transformer` beside it (only the framework-free `torch_reference.config`), `train` above
both, `parity` above all of them (its commands use `train`, never the reverse: no module of
`train` imports `parity`); no file imports another that imports it back. Checked on every
import statement of every file, those inside functions included, and on dynamic imports: a string
constant naming a project module (`importlib.import_module("train.backends.jax_backend")`, or a
table of such names) counts as an import of it, but for the module a child process runs
(`[sys.executable, "-m", "train.commands.serve", ...]`).

The framework checks run in a fresh interpreter: in this pytest process torch and jax are long
imported. The child prints the top-level names in `sys.modules` as JSON; the assertions are made
here, so a failure lists the offending modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from train.commands import COMMANDS as AIAYN_COMMANDS

REPO_ROOT = Path(__file__).resolve().parents[1]
JAX_MODULES = {"jax", "jaxlib", "flax", "optax", "orbax"}
PACKAGES = ("torch_reference", "jax_transformer", "train", "parity")
# What each package may import of the project (its own files aside).
MAY_IMPORT = {
    "torch_reference": set(),
    "jax_transformer": {"torch_reference.config"},
    "train": {"torch_reference", "jax_transformer"},
    "parity": {"torch_reference", "jax_transformer", "train"},
}
AIAYN = "train.commands"  # the package that holds `aiayn`'s table of commands


def project_modules() -> dict[str, Path]:
    """{dotted module name: file} for every file of the four packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    # `[sys.executable, "-m", "pkg.mod", ...]`: a module run in a child process, not imported
    child_runs = {id(b) for node in ast.walk(tree) if isinstance(node, (ast.List, ast.Tuple))
                  for a, b in zip(node.elts, node.elts[1:]) if isinstance(a, ast.Constant) and a.value == "-m"}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports pkg.mod when it is a module, else pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value
              and node.value in modules and id(node) not in child_runs):
            targets = [node.value]  # a dynamic import: import_module("pkg.mod") or a table of names (a bare
            # "train" is a dictionary key more often than a module name)
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a module a.b: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles_of(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle a depth-first walk of `graph` meets, as "a -> b -> a"."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_dependencies_run_one_way_without_cycles():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["train.rundir"] >= {"train.checkpoints", "train.config", "train.data"}  # the parser sees imports
    assert "train.translation" in graph["train.loop"] and "train.api" in graph["train.translate.jobs"]
    # The backend factory's table of module names is seen as importing them.
    assert graph["train.backends"] >= {"train.backends.jax_backend", "train.backends.torch_backend"}
    assert "train.commands.serve" not in graph["train.serving.loadgen"]  # it starts the server in a child process

    assert "train.interop.runs" in graph["train.pretrained"]  # --init-from converts through the library itself
    # `aiayn`'s table (train.commands) names every command, parity's too: it stands above both packages.
    assert {"parity.commands.convert", "train.commands.run"} <= graph.pop(AIAYN)
    upward = [f"{name} imports {target}" for name, targets in graph.items() if name.split(".")[0] == "train"
              for target in sorted(targets) if target.split(".")[0] == "parity"]
    assert not upward, "train importing parity:\n  " + "\n  ".join(upward)
    wrong = []
    for name, targets in graph.items():
        package = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            allowed = MAY_IMPORT[package]
            if other != package and other not in allowed and target not in allowed:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against the order:\n  " + "\n  ".join(wrong)
    cycles = cycles_of(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_a_cycle_through_a_dynamic_import_is_found(tmp_path):
    """The knot this test once missed: a run-directory module imports the backend factory, which
    loads a backend by name with importlib, and the backend imports the run-directory module."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rundir.py").write_text("from .factory import create\n")
    (package / "factory.py").write_text(
        'import importlib\nMODULES = {"jax": "pkg.backend"}\n'
        "def create(kind):\n    return importlib.import_module(MODULES[kind])\n"
    )
    (package / "backend.py").write_text("def save():\n    from pkg import rundir\n")
    modules = {f"pkg.{p.stem}" if p.stem != "__init__" else "pkg": p for p in package.glob("*.py")}
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.factory"] == {"pkg.backend"}
    assert cycles_of(graph) == ["pkg.backend -> pkg.rundir -> pkg.factory -> pkg.backend"]


def loaded_after(code: str) -> set[str]:
    """Top-level module names in sys.modules after running `code` in a new interpreter."""
    script = textwrap.dedent(code) + textwrap.dedent(
        """
        import json as _json, sys as _sys
        print(_json.dumps(sorted({name.split(".")[0] for name in _sys.modules})))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_config_imports_neither_framework():
    loaded = loaded_after(
        """
        import torch_reference
        from torch_reference import TransformerConfig
        cfg = TransformerConfig.preset("tiny")
        assert cfg.d_model == 64
        """
    )
    assert "torch_reference" in loaded  # the import did happen
    assert not loaded & JAX_MODULES
    # The package loads torch lazily (PEP 562), so the config alone is framework-free.
    assert "torch" not in loaded


def test_torch_model_does_not_import_jax():
    loaded = loaded_after(
        """
        import torch_reference.model
        from torch_reference import Transformer
        """
    )
    assert "torch" in loaded  # the model did load its framework
    assert not loaded & JAX_MODULES


def test_jax_package_does_not_import_torch_and_shares_the_config():
    loaded = loaded_after(
        """
        import sys
        import jax_transformer
        import torch_reference.config
        assert "torch" not in sys.modules, "torch imported before the identity check"
        assert jax_transformer.TransformerConfig is torch_reference.config.TransformerConfig
        """
    )
    assert "jax" in loaded  # the JAX package did load its framework
    assert "torch" not in loaded


def test_checkpoint_stores_know_neither_run_directories_nor_backends():
    """train.checkpoints and each framework's store reach neither the run machinery (train.runtime, but for its
    atomic files) nor train.backends, directly
    or through other modules; the framework-neutral part and torch's store load no framework."""
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    stores = sorted(name for name in graph if name.split(".")[:2] == ["train", "checkpoints"])
    assert stores == ["train.checkpoints", "train.checkpoints.jax_store", "train.checkpoints.torch_store"]
    assert "train.rundir" in reachable(graph, "train.commands.average")  # the walk does find what is imported
    for store in stores:
        wrong = {m for m in reachable(graph, store)
                 if m.split(".")[:2] in (["train", "runtime"], ["train", "backends"]) and m != "train.runtime.files"}
        assert not wrong, f"{store} reaches {sorted(wrong)}"
    loaded = loaded_after("import train.checkpoints, train.checkpoints.torch_store")
    assert "safetensors" in loaded and not loaded & (JAX_MODULES | {"torch"})


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_every_name_imported_from_the_project_exists():
    """`from PACKAGE.module import name` anywhere in the repository, tests and code inside
    functions included, names something that module has (a name that moved is found here, not
    when the one test importing it runs). In a child process: it imports every module."""
    code = textwrap.dedent(f"""
        import ast, importlib, json, pathlib, sys
        missing = []
        for path in sorted(pathlib.Path({str(REPO_ROOT)!r}).glob("**/*.py")):
            if ".venv" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in {PACKAGES!r}):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        try:
                            importlib.import_module(node.module + "." + alias.name)
                        except ImportError:
                            missing.append(f"{{path.relative_to({str(REPO_ROOT)!r})}}:{{node.lineno}} {{node.module}}.{{alias.name}}")
        print(json.dumps(missing))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# The commands, by docs/design.md's one rule: every module in a `commands/` folder, and `train.run`, the
# quick start's alias of `train.commands.run`; `aiayn` (`train.commands`) names all the others.
COMMANDS = {name for name in project_modules() if name.split(".")[1:2] == ["commands"]} | {"train.run"}
COMMAND_PACKAGES = {"train.commands", "parity.commands"}


def test_no_module_imports_a_command():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    named = {command.module for command in AIAYN_COMMANDS.values()}
    assert named == COMMANDS - COMMAND_PACKAGES - {"train.run"}  # aiayn names every one
    # Nor does a command import another: what two commands share is library code (`aiayn` and the alias only
    # name them).
    wrong = [f"{name} imports {target}" for name, targets in graph.items()
             if name not in (AIAYN, "train.run") for target in sorted(targets & COMMANDS)]
    assert not wrong, "modules importing commands:\n  " + "\n  ".join(wrong)
    assert graph[AIAYN] >= named  # the walk sees aiayn's table of commands
    assert graph["train.run"] == {"train.commands.run"}  # the alias runs the command, by name
