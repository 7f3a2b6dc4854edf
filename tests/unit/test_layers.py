"""Dependencies point one way; the contract itself lives in pyproject.toml.

`make lint` runs `lint-imports`; running it here too keeps `make test` honest
on its own. The contract is exhaustive, so a new module that is not placed in
a layer fails as surely as an upward import.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "devplugin"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert tool is not None, "import-linter is a dev dependency"
    return subprocess.run(
        [tool, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_layer_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    count = len(contracts["contracts"])
    assert count >= 2  # the package's layers and the policy package's own
    assert f"{count} kept, 0 broken" in result.stdout


def test_the_contract_catches_a_production_module_importing_the_testing_package(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(PACKAGE, copy / "devplugin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with (copy / "devplugin" / "node" / "resources.py").open("a") as module:
        module.write("\nfrom devplugin.testing import node as _node  # noqa: E402\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, '.'); "
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--no-cache",
        ],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "devplugin.node is not allowed to import devplugin.testing" in result.stdout
    assert "devplugin.node.resources -> devplugin.testing.node" in result.stdout


def test_only_the_nvml_module_imports_pynvml() -> None:
    importers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "pynvml" in imports_of(path)
    )
    assert importers == ["node/discovery/nvml.py"]


def test_no_test_module_imports_another() -> None:
    # Shared helpers live in conftest, the *_support modules, support.py or
    # devplugin.testing: a test module is never another's library.
    tests = ROOT / "tests"
    found = [
        f"{path.relative_to(tests)}: {line.strip()}"
        for path in sorted(tests.rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.match(r"\s*(from tests\.(\w+\.)?test_\w+ import|import tests\.(\w+\.)?test_)", line)
    ]
    assert found == []


# Functions allowed past LONGEST lines, each with why. Every other function
# of the project (production, simulators, bench, scripts, tests) fits.
LONGEST = 100
LONG_ON_PURPOSE = {
    # One declaration per metric: a table, read top to bottom.
    ("devplugin/node/metrics.py", "__init__"),
    # The Python twin of _foldc.c, kept whole to read beside it.
    ("devplugin/policy/fold.py", "_forward"),
    # One storm scenario: its killer and actors share its state.
    ("tests/cluster/test_custody.py", "test_sigkill_at_random_moments_under_a_storm_keeps_custody"),
}


def test_no_function_is_longer_than_a_hundred_lines_but_the_listed_ones() -> None:
    found = set()
    too_long = []
    for folder in ("devplugin", "bench", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "api" in path.relative_to(ROOT).parts[:2]:
                continue  # generated protobuf code
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if (where, node.name) in LONG_ON_PURPOSE:
                    found.add((where, node.name))
                elif lines > LONGEST:
                    too_long.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    assert not too_long, "split these, or list them with why: " + ", ".join(too_long)
    # A listed exception that no longer exists (or was split) leaves the list.
    assert found == LONG_ON_PURPOSE, LONG_ON_PURPOSE - found


def _table(statement: ast.stmt) -> bool:
    """A statement whose value is a literal table (a dict, list, tuple or
    set, or a call whose last argument is one: `api.put("nodes", {...})`)."""
    value = getattr(statement, "value", None)
    literal = ast.Dict | ast.List | ast.Tuple | ast.Set | ast.ListComp | ast.DictComp
    if isinstance(value, literal):
        return True
    return (
        isinstance(statement, ast.Expr)
        and isinstance(value, ast.Call)
        and bool(value.args)
        and isinstance(value.args[-1], ast.Dict | ast.List)
    )


def test_fmt_skip_marks_only_tables() -> None:
    """The formatter's layout is the house style; a table may keep its own."""
    marker = "# fmt" + ": skip"
    elsewhere = []
    for folder in ("devplugin", "bench", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if marker not in text:
                continue
            ending: dict[int, list[ast.stmt]] = {}
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.stmt):
                    ending.setdefault(node.end_lineno or node.lineno, []).append(node)
            for number, line in enumerate(text.splitlines(), 1):
                if marker in line and not any(_table(s) for s in ending.get(number, [])):
                    elsewhere.append(f"{path.relative_to(ROOT)}:{number}")
    assert not elsewhere, f"{marker} on a statement that is not a table: {elsewhere[:10]}"
