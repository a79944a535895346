"""The suite's own rules (docs/testing.md): every test lives in a tier folder, and no test module
imports another test module (shared helpers live in tests/support/ and tests/conftest.py)."""

import ast
import os

from tests.conftest import REPO, TIERS

TESTS = os.path.join(REPO, "tests")


def _test_modules():
    for root, _, files in os.walk(TESTS):
        for f in sorted(files):
            if f.startswith("test_") and f.endswith(".py"):
                yield os.path.join(root, f)


def imported_test_modules(source: str) -> list[str]:
    """The test modules (`test_*`) a test file's source imports, anywhere in it (including the
    source of child scripts held in strings is out of reach: those import tests.support)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [n for n in names if n.startswith("tests.") and n.split(".")[-1].startswith("test_")]
    return out


def test_every_test_module_is_in_a_tier_folder():
    misplaced = [
        os.path.relpath(p, TESTS)
        for p in _test_modules()
        if os.path.relpath(p, TESTS).split(os.sep)[0] not in TIERS
    ]
    assert not misplaced, misplaced


def test_no_test_module_imports_another():
    bad = {}
    for path in _test_modules():
        with open(path, encoding="utf-8") as f:
            found = imported_test_modules(f.read())
        if found:
            bad[os.path.relpath(path, TESTS)] = found
    assert not bad, bad


def test_the_rule_catches_an_import_of_a_test_module():
    assert imported_test_modules("from tests.integration.test_trainer import config")
    assert imported_test_modules("from tests.unit import test_data")
    assert not imported_test_modules("from tests.support.runs import realm_config")


def test_the_longest_first_modules_exist():
    """conftest.LONGEST_FIRST names modules that are there (a renamed one would go last)."""
    from tests.conftest import LONGEST_FIRST

    missing = [m for m in LONGEST_FIRST if not os.path.isfile(os.path.join(REPO, "tests", m))]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names missing modules: {missing}"


def _system_marked(path: str) -> tuple[bool, dict[str, bool], list[str]]:
    """(the module is marked system as a whole, {test function: marked system}, the names of
    non-test functions that carry the mark) of a test module, read from its source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    whole = any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
        and "mark.system" in ast.unparse(n.value)
        for n in tree.body
    )
    tests, stray = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            marked = any("mark.system" in ast.unparse(d) for d in node.decorator_list)
            if node.name.startswith("test_"):
                tests[node.name] = marked or whole
            elif marked:
                stray.append(node.name)
    return whole, tests, stray


def test_the_system_mark_decorates_tests_only():
    """A `@pytest.mark.system` on a helper marks nothing: the test below it stays in CI (it
    happened: the gradient accumulation test ran in make test for a session)."""
    bad = {}
    for path in _test_modules():
        stray = _system_marked(path)[2]
        if stray:
            bad[os.path.relpath(path, TESTS)] = stray
    assert not bad, f"pytest.mark.system on functions that are not tests: {bad}"


MODULE_AND_TEST = r"((?:unit|integration|system)/[\w/]+\.py)(?:::(\w+(?:\.\.\.)?))?"


def moved_tests(text: str) -> list[tuple[str, str]]:
    """(module, test name or prefix ending in '...', or '' for the whole module) named in the
    first column of docs/testing.md's table of tests moved out of CI."""
    import re

    section = text.split("## What guards each promise in CI", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        module = None
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            m = re.fullmatch(MODULE_AND_TEST, token)
            if m:
                module = m.group(1)
                out.append((module, m.group(2) or ""))
            elif module and re.fullmatch(r"::\w+(?:\.\.\.)?", token):
                out.append((module, token[2:]))
    return out


def test_every_test_the_docs_moved_out_of_ci_is_marked_system():
    """docs/testing.md's table names tests that left make test: each is in tests/system/ or
    marked system (a parametrised case, `name[id]`, is not read here)."""
    with open(os.path.join(REPO, "docs", "testing.md"), encoding="utf-8") as f:
        named = moved_tests(f.read())
    assert len(named) > 20, named  # the table was found and read
    problems = []
    for module, name in named:
        path = os.path.join(TESTS, module)
        if not os.path.isfile(path):
            problems.append(f"{module}: no such test module")
            continue
        if module.startswith("system/"):
            continue
        whole, tests, _ = _system_marked(path)
        if not name:
            if not (whole or (tests and all(tests.values()))):
                problems.append(f"{module}: not marked system")
            continue
        prefix = name.endswith("...")
        hits = [t for t in tests if (t.startswith(name[:-3]) if prefix else t == name)]
        if not hits:
            problems.append(f"{module}::{name}: no such test")
        problems += [f"{module}::{t}: not marked system" for t in hits if not tests[t]]
    assert not problems, problems


def test_the_docs_rule_reads_the_table():
    table = (
        "## What guards each promise in CI\n\n| moved | promise | guard |\n|---|---|---|\n"
        "| `integration/test_a.py::test_one...`, `::test_two` (x) | p | `unit/test_b.py` |\n"
        "| `system/test_c.py` | p | g |\n\n## Rules\n| `unit/test_d.py` | not this table |\n"
    )
    assert moved_tests(table) == [
        ("integration/test_a.py", "test_one..."),
        ("integration/test_a.py", "test_two"),
        ("system/test_c.py", ""),
    ]
