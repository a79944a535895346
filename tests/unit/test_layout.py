"""The package's rooms (../shared/DESIGN.md "Layout"): imports go from a room only to rooms
below it in LAYERS (toward the foundations), and no task imports another."""

import os

from tests.conftest import REPO
from tests.support.source import package_imports

PKG = os.path.join(REPO, "realm_jax")
# Lowest first. A module may import its own room and any room of a lower layer.
LAYERS = [
    {"config", "fs", "workdir", "lock", "runtime", "tokenization", "sharding", "checkpoint"}
    | {"protowire"},
    {"data", "model", "ops"},
    {"index"},
    {"train"},
    {"pretrain", "ict", "qa"},  # the tasks
    {"cli", "__main__", "sweep", "plan", "interop"},  # entry points (cli names commands as strings)
]
TASKS = LAYERS[4]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(room: str) -> int:
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"realm_jax.{room} is in no room of LAYERS: give it one")


def _modules():
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def violations(module: str, imports: set[str]) -> list[str]:
    room, bad = _room(module), []
    for imp in sorted(imports):
        target = _room(imp)
        if target == room or target == "__init__" or room == "__init__":
            continue
        if _layer(target) > _layer(room):
            bad.append(f"{module} imports {imp} (a higher room)")
        elif room in TASKS and target in TASKS:
            bad.append(f"{module} imports {imp} (a task imports another task)")
        elif _layer(target) == _layer(room) and _layer(room) not in (0, len(LAYERS) - 1):
            bad.append(f"{module} imports {imp} (a sibling room)")
    return bad


def test_every_module_has_a_room_and_imports_point_down():
    bad = [v for module, path in _modules() for v in violations(module, package_imports(path))]
    assert not bad, "\n".join(bad)


def test_the_rule_catches_bad_imports():
    assert violations("realm_jax.index.feed", {"realm_jax.pretrain.step"})  # upward
    assert violations("realm_jax.ict.step", {"realm_jax.pretrain.losses"})  # task -> task
    assert violations("realm_jax.model.realm", {"realm_jax.ops.mips"})  # sibling rooms
    assert not violations("realm_jax.pretrain.step", {"realm_jax.index.corpus"})
