"""pyproject.toml declares what the package needs as ranges and requirements.txt pins it: every
runtime dependency and extra is pinned in the lock at a version its range accepts."""

import os
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO


def _lock() -> dict[str, str]:
    pins = {}
    with open(os.path.join(REPO, "requirements.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier  # one exact pin a line
                assert spec.operator == "==", line
                pins[canonicalize_name(req.name)] = spec.version
    return pins


def _project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_every_runtime_dependency_is_pinned_in_range():
    lock, deps = _lock(), [Requirement(d) for d in _project()["dependencies"]]
    assert len(deps) > 15
    for req in deps:
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is a dependency but not pinned in requirements.txt"
        assert req.specifier.contains(lock[name], prereleases=True), (req, lock[name])


def test_extras_name_the_documented_targets_and_pins_fit():
    lock, extras = _lock(), _project()["optional-dependencies"]
    assert {"tpu", "cuda", "beam", "dev"} <= set(extras)
    assert any(Requirement(r).extras == {"cuda12"} for r in extras["cuda"])
    for group in ("beam", "dev"):
        for req in map(Requirement, extras[group]):
            name = canonicalize_name(req.name)
            if name in lock:  # psutil comes with the lock's other packages, unpinned
                assert req.specifier.contains(lock[name], prereleases=True), (req, lock[name])


def test_the_lock_holds_no_package_the_project_does_not_declare():
    project = _project()
    declared = {canonicalize_name(Requirement(d).name) for d in project["dependencies"]}
    for group in project["optional-dependencies"].values():
        declared |= {canonicalize_name(Requirement(d).name) for d in group}
    assert set(_lock()) - declared == set(), set(_lock()) - declared
