"""The suite's layout stays as tests/helpers/__init__.py describes it, read from the sources (ast): transformers
configs are written only in tests/helpers/configs.py, nothing under tests/ adds to the import path, no module
imports a test module, and the tolerance TOL is defined once (tests/helpers/exact.py) with its values nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FILES = sorted(TESTS.rglob("*.py"))
CONFIGS = TESTS / "helpers" / "configs.py"
EXACT = TESTS / "helpers" / "exact.py"
TEST_MODULES = {path.stem for path in TESTS.glob("test_*.py")}
_PATH_EDITS = {
    "insert",
    "append",
    "extend",
    "remove",
    "pop",
    "clear",
    "reverse",
    "sort",
    "__setitem__",
    "__delitem__",
    "__iadd__",
}


def _trees(files: list[Path]):
    for path in files:
        yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    shown = path.relative_to(TESTS.parent) if path.is_relative_to(TESTS.parent) else path
    return f"{shown}:{getattr(node, 'lineno', 0)}"


def _config_classes() -> set[str]:
    """The names of transformers' model config classes (LlamaConfig, GPT2Config, ...) and their base."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return {*CONFIG_MAPPING_NAMES.values(), "PretrainedConfig", "PreTrainedConfig"}


def _name(node: ast.AST) -> str | None:
    """``f`` of ``f(...)`` or ``module.f(...)``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and _name(node.value) == "sys"


def _constant(node: ast.AST) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def configs_written_outside_the_helper(files: list[Path] = FILES) -> list[str]:
    """Calls of a config class, by name or as ``getattr(transformers, "...Config")``, outside configs.py."""
    classes = _config_classes()
    found = []
    for path, tree in _trees([f for f in files if f != CONFIGS]):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if _name(node.func) in classes:  # LlamaConfig(...), transformers.LlamaConfig(...)
                found.append(f"{_where(path, node)}: {_name(node.func)}(")
            elif _name(node.func) == "getattr" and len(node.args) > 1 and _constant(node.args[1]) in classes:
                found.append(f"{_where(path, node)}: getattr(..., {_constant(node.args[1])!r})")
    return found


def import_path_edits(files: list[Path] = FILES) -> list[str]:
    """Changes to sys.path: its list methods, assignments to it or its items, monkeypatch.syspath_prepend,
    site.addsitedir, and setattr(sys, "path", ...) with anything but a copy of itself (the path kept as it was)."""
    found = []
    for path, tree in _trees(files):
        for node in ast.walk(tree):
            where = _where(path, node)
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in _PATH_EDITS and _is_sys_path(func.value):
                    found.append(f"{where}: sys.path.{func.attr}(...)")
                elif _name(func) in ("syspath_prepend", "addsitedir"):
                    found.append(f"{where}: {_name(func)}(...)")
                elif (
                    _name(func) == "setattr"
                    and len(node.args) == 3
                    and _name(node.args[0]) == "sys"
                    and _constant(node.args[1]) == "path"
                    and not _copy_of_sys_path(node.args[2])
                ):
                    found.append(f"{where}: setattr(sys, 'path', ...)")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else [*node.targets]
                if isinstance(node, ast.Delete)
                else []
            )
            for target in targets:
                if _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value)):
                    found.append(f"{where}: assignment to sys.path")
    return found


def _copy_of_sys_path(node: ast.AST) -> bool:
    """``[*sys.path]`` or ``list(sys.path)``."""
    if isinstance(node, ast.List) and len(node.elts) == 1 and isinstance(node.elts[0], ast.Starred):
        return _is_sys_path(node.elts[0].value)
    return (
        isinstance(node, ast.Call) and _name(node.func) == "list" and len(node.args) == 1 and _is_sys_path(node.args[0])
    )


def imports_of_test_modules(files: list[Path] = FILES, test_modules: set[str] = TEST_MODULES) -> list[str]:
    """``import test_x``, ``from tests import test_x``, ``from .test_x import ...`` and the like."""
    found = []
    for path, tree in _trees(files):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                modules = [base, *(f"{base}.{alias.name}" if base else alias.name for alias in node.names)]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[-1] in test_modules and parts[:-1] in ([], ["tests"]):
                    found.append(f"{_where(path, node)}: imports {module}")
    return found


def tolerances_outside_the_helper(files: list[Path] = FILES) -> list[str]:
    """``TOL = ...`` anywhere but tests/helpers/exact.py, and TOL's values (rtol 1e-4 with atol 1e-5) written
    again, as keywords or as a dict."""
    found = []
    for path, tree in _trees([f for f in files if f != EXACT]):
        for node in ast.walk(tree):
            where = _where(path, node)
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == "TOL" for t in targets):
                found.append(f"{where}: TOL =")
            if isinstance(node, ast.Call):
                given = {k.arg: _constant(k.value) for k in node.keywords if k.arg}
                if given.get("rtol") == 1e-4 and given.get("atol") == 1e-5:
                    found.append(f"{where}: rtol=1e-4, atol=1e-5 (TOL's values)")
            if isinstance(node, ast.Dict):
                given = {_constant(k): _constant(v) for k, v in zip(node.keys, node.values, strict=True) if k}
                if given.get("rtol") == 1e-4 and given.get("atol") == 1e-5:
                    found.append(f"{where}: a dict of TOL's values")
    return found


def test_transformers_configs_are_written_only_in_the_helper():
    assert not configs_written_outside_the_helper(), configs_written_outside_the_helper()


def test_nothing_under_tests_edits_the_import_path():
    assert not import_path_edits(), import_path_edits()


def test_no_module_imports_a_test_module():
    assert not imports_of_test_modules(), imports_of_test_modules()


def test_the_tolerance_is_defined_once():
    assert not tolerances_outside_the_helper(), tolerances_outside_the_helper()


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check flags a file that breaks its rule (the suite itself passing them proves little alone)."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import sys\nfrom transformers import LlamaConfig\nimport transformers\nfrom tests import test_ops\n"
        "from .test_plan import x\nimport tests.test_fold\n\nTOL = {'rtol': 1e-4, 'atol': 1e-5}\n"
        "sys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\n"
        "def f(monkeypatch, a, b):\n    monkeypatch.syspath_prepend('w')\n    setattr(sys, 'path', ['v'])\n"
        "    setattr(sys, 'path', [*sys.path])\n"  # keeping the path as it was: allowed
        "    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)\n    LlamaConfig(vocab_size=8)\n"
        "    getattr(transformers, 'MistralConfig')()\n    return transformers.GPT2Config()\n"
    )
    assert len(configs_written_outside_the_helper([bad])) == 3
    assert len(import_path_edits([bad])) == 5
    assert len(imports_of_test_modules([bad], {"test_ops", "test_plan", "test_fold"})) == 3
    assert len(tolerances_outside_the_helper([bad])) == 3
