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
