"""The shape of the packages: no import cycle, no torch in the solver, the entry points that run
without it; profiling's layering (the executors' dispatcher, no solver.cli).

The solver needs no torch (README): ``import solver`` and every ``python -m solver.*`` CLI must
work where torch is not installed, and nothing in solver/ imports ``profiling`` (``--find
max-scale`` finds its graph source through an entry point). The import graph is read from the
source with ``ast``, function-level imports included, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import itertools
import pkgutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import solver
from tests.conftest import GPT_1_3B, ROOT

SOLVER_DIR = ROOT / "solver"
TORCH_PACKAGES = ("torch", "torchvision", "torchaudio", "functorch", "triton", "transformers")
"""Blocked in the no-torch subprocesses: torch and the packages that import it."""
TORCH_USERS = ("profiling", "models")
"""This project's torch packages: never imported by solver/ at module level."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOLVER_FILES = {_module_name(path): path for path in sorted(SOLVER_DIR.rglob("*.py"))}


def _imports(
    module: str, path: Path, known: dict[str, Path] = SOLVER_FILES
) -> list[tuple[str, bool]]:
    """(imported module name, inside a function?) for every import statement of a module.
    ``from pkg import name`` names ``pkg.name`` when that is a module of ``known``, else ``pkg``;
    relative imports are resolved against the module's package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import z
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in known else base, in_function))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def test_the_solver_package_has_no_import_cycle():
    graph = nx.DiGraph()
    graph.add_nodes_from(SOLVER_FILES)
    for module, path in SOLVER_FILES.items():
        for target, _ in _imports(module, path):
            if target in SOLVER_FILES and target != module:
                graph.add_edge(module, target)
    assert graph.number_of_edges() > len(SOLVER_FILES)  # the walk did find the imports
    cycles = [" -> ".join([*c, c[0]]) for c in itertools.islice(nx.simple_cycles(graph), 20)]
    assert not cycles, "import cycles in solver/:\n" + "\n".join(sorted(cycles, key=len))


def test_the_solver_never_imports_torch_profiling_or_models_even_lazily():
    """Not at module level, not inside a function: ``--find max-scale`` finds its graph source
    through an entry point (``GRAPH_SOURCES``), and nothing else in solver/ needs torch."""
    offences = []
    for module, path in SOLVER_FILES.items():
        for target, in_function in _imports(module, path):
            top = target.partition(".")[0]
            if top in TORCH_PACKAGES or top in TORCH_USERS:
                where = "in a function" if in_function else "at module level"
                offences.append(f"{path.relative_to(ROOT)} imports {target} {where}")
    assert not offences, "\n".join(offences)


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (cwd: the repository) where importing torch, or any
    package that needs it, fails as if it were not installed; then check that none was loaded
    and exit with ``exit_code``."""
    prelude = (
        "import sys\n"
        f"for name in {TORCH_PACKAGES!r}:\n"
        "    sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec gives None\n"
    )
    epilogue = (
        "\nloaded = [m for m, v in sys.modules.items() if v is not None"
        f" and m.partition('.')[0] in {TORCH_PACKAGES!r}]\n"
        "assert not loaded, loaded\n"
        "raise SystemExit(exit_code)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + "exit_code = 0\n" + code + epilogue],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def _run_module(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m module *argv`` without torch; its return code is the CLI's exit code."""
    return _run_without_torch(
        "import runpy\n"
        f"sys.argv = [{module!r}, *{argv!r}]\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as stop:\n"
        "    exit_code = stop.code\n"
    )


@pytest.mark.slow
def test_every_solver_module_imports_without_torch():
    names = ["solver"] + [
        info.name for info in pkgutil.walk_packages(solver.__path__, prefix="solver.")
    ]
    assert set(names) == set(SOLVER_FILES)  # the walk finds every file
    code = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    result = _run_without_torch(code)
    assert result.returncode == 0, result.stderr


CLI_RUNS = {  # run from the repository root; {tmp} is the test's tmp_path
    "plan": "solver.plan examples/gpt-1.3b.json --gpus 8 --global-batch 64 --time-limit 10",
    "evaluate": "solver.evaluate examples/gpt-1.3b.json --pp 4 --tp 2 --global-batch 64 "
    "--split even",
    "sweep": "solver.sweep examples/gpt-1.3b.json --gpus 8,16 --global-batch 64 "
    "--out {tmp}/sweep.csv --workers 1",
}


@pytest.mark.slow
@pytest.mark.parametrize("command", CLI_RUNS.values(), ids=CLI_RUNS.keys())
def test_every_solver_cli_runs_without_torch(command, tmp_path):
    module, *args = command.format(tmp=tmp_path).split()
    result = _run_module(module, args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    if "--out" in args:  # the sweep's CSV: a header and a row per GPU count
        assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 3


@pytest.mark.slow
def test_max_scale_without_torch_exits_2_saying_torch_is_needed():
    argv = ["--find", "max-scale", "--model", "gpt-tiny", "--scale", "layers"]
    result = _run_module("solver.sweep", [*argv, "--gpus", "8", "--global-batch", "8"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "needs torch" in result.stderr and result.stdout == ""


def test_solver_plan_and_solver_evaluate_are_the_api_functions():
    """``import solver.plan`` binds the module to ``solver.plan``; calling it still plans."""
    import solver.evaluate
    import solver.plan

    graph = solver.load_graph(GPT_1_3B)
    cluster = solver.Cluster(num_gpus=8)
    training = solver.TrainingConfig(global_batch=64, pp=4, tp=2)
    result = solver.plan(graph, cluster, training)
    assert isinstance(result, solver.Plan) and result.config.pp == 4
    evaluation = solver.evaluate(
        graph, result.config, result.stage_of_layer, cluster=cluster, training=training
    )
    assert isinstance(evaluation, solver.Evaluation)
    assert evaluation.peak_bytes == result.peak_bytes


# -- profiling and models ----------------------------------------------------------------------

PROFILING_FILES = {
    _module_name(path): path
    for package in ("profiling", "models")
    for path in sorted((ROOT / package).rglob("*.py"))
}
EXECUTORS = "profiling.executors"


def _import_graph(files: dict[str, Path]) -> nx.DiGraph:
    """module -> module it imports (module level or in a function), within ``files``."""
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for target, _ in _imports(module, path, files):
            if target in files and target != module:
                graph.add_edge(module, target)
    return graph


def test_profiling_and_models_have_no_import_cycle():
    """Lazy imports count: the executors' dispatcher is apart from the executors it picks."""
    graph = _import_graph(PROFILING_FILES)
    assert graph.number_of_edges() > len(PROFILING_FILES) // 2  # the walk did find the imports
    cycles = [" -> ".join([*c, c[0]]) for c in itertools.islice(nx.simple_cycles(graph), 20)]
    assert not cycles, "import cycles in profiling/, models/:\n" + "\n".join(sorted(cycles))


def test_the_dispatcher_imports_every_executor_and_none_imports_it():
    graph = _import_graph(PROFILING_FILES)
    dispatch = f"{EXECUTORS}.dispatch"
    executors = {f"{EXECUTORS}.{name}" for name in ("torch_zoo", "traced", "megatron")}
    assert executors <= set(graph.successors(dispatch))
    importers = set(graph.predecessors(dispatch))
    assert importers <= {"profiling.run", f"{EXECUTORS}.preload"}, importers
    # the fork server's preload reaches every module a rank runs (profiling.run.RANK_PRELOAD)
    ranks_run = nx.descendants(graph, dispatch) | {dispatch}
    assert ranks_run <= nx.descendants(graph, f"{EXECUTORS}.preload")


def test_profiling_never_imports_the_solvers_cli():
    """profiling's CLIs share solver.console with the solver's; solver.cli is the solver's own."""
    offences = [
        f"{path.relative_to(ROOT)} imports {target}"
        for module, path in PROFILING_FILES.items()
        for target, _ in _imports(module, path, PROFILING_FILES)
        if target == "solver.cli" or target.startswith("solver.cli.")
    ]
    assert not offences, "\n".join(offences)


def test_max_scale_loads_its_graph_source_from_the_entry_point_group(monkeypatch):
    from importlib.metadata import EntryPoint

    import profiling.presets
    from solver.cli import sweep as sweep_cli

    zoo = EntryPoint(name="zoo", value="profiling.presets", group=sweep_cli.GRAPH_SOURCES)
    other = EntryPoint(name="other", value="no.such.module", group=sweep_cli.GRAPH_SOURCES)
    asked = []

    def entry_points(*, group):
        asked.append(group)
        return [other, zoo]

    monkeypatch.setattr(sweep_cli, "entry_points", entry_points)
    assert sweep_cli.graph_source() is profiling.presets
    assert asked == ["memplan.graph_sources"]


def test_max_scale_without_a_graph_source_is_one_input_error(monkeypatch):
    from solver.cli import sweep as sweep_cli
    from solver.errors import InputError

    monkeypatch.setattr(sweep_cli, "entry_points", lambda *, group: [])
    with pytest.raises(InputError) as error:
        sweep_cli.graph_source()
    message = str(error.value)
    assert "\n" not in message and "needs torch" in message
    assert "memplan.graph_sources" in message and "pip install -e '.[profiling]'" in message


def test_pyproject_declares_the_zoo_graph_source():
    """The entry point ``--find max-scale`` looks up (installed by pip install -e .)."""
    tomllib = pytest.importorskip("tomllib")
    from solver.cli.sweep import GRAPH_SOURCES

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][GRAPH_SOURCES] == {"zoo": "profiling.presets"}


def test_import_profiling_is_cheap_and_names_the_public_api():
    """``import profiling`` needs no torch; its public names load their modules on first use."""
    result = _run_without_torch(
        "import profiling\n"
        "assert sorted(profiling.__all__) == "
        "['export_graph', 'format_reports', 'profile_module', 'run_plan']\n"
    )
    assert result.returncode == 0, result.stderr
    import profiling
    from profiling.run import run_plan

    assert profiling.run_plan is run_plan
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        profiling.nope  # noqa: B018


# -- sizes: a module a reader can hold, functions a reader can follow ------------------------

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def _python_files(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_of_solver_or_profiling_is_over_800_lines():
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in _python_files("solver", "profiling")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "split these by concern (docs/architecture.md):\n" + "\n".join(long)


@pytest.mark.slow
def test_no_function_is_over_100_lines():
    """Every function and method of the product, the zoo and the benchmarks (decorators and
    docstring included)."""
    long = []
    for path in _python_files("solver", "profiling", "models", "scripts"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, "split these where a reader gains:\n" + "\n".join(long)
