"""The package's rooms (../shared/DESIGN.md "Layout"): imports go from a room only to rooms
below it in LAYERS (toward the foundations), no task imports another, and no module imports
itself back through others (no import cycle, lazy imports inside functions included).

interop/ (foreign formats) sits BELOW data/ and model/: its readers and writers (protobuf wire,
TFRecord, TF1 checkpoints, torch pickles, HF folders, the release's block records, REALM's
annotated shards) need only the foundations, and data/ reads the release's block records and
REALM's shards as corpus sources, train/ reads HF folders (warm start). Its import/export
command is the exception: it builds models, checkpoints and indexes, so interop/commands.py is a
room of its own at the entry-point layer (SUBROOMS). The error every corpus reader raises,
CorpusError, lives in the foundations (corpus_errors.py) for the same reason: the readers of
interop/ cannot import data/corpus.py.
"""

import os

from tests.conftest import REPO
from tests.support.source import module_imports

PKG = os.path.join(REPO, "realm_jax")
# Lowest first. A module may import its own room and any room of a lower layer.
LAYERS = [
    {"config", "fs", "workdir", "lock", "runtime", "tokenization", "sharding", "checkpoint"}
    | {"corpus_errors", "watchdog", "hlo_audit", "hlo_cost", "run_record", "validation"}
    | {"sweep.trial"},  # a sweep trial's link, which the training loop reports to
    {"interop"},  # foreign formats in and out: bytes and arrays, no model, no corpus
    {"data", "model", "ops"},
    {"index"},
    {"train"},
    {"pretrain", "ict", "qa"},  # the tasks
    {"cli", "__main__", "sweep", "plan", "interop.commands", "api"},  # entry points (cli: strings)
]
TASKS = LAYERS[5]
# Modules that are a room of their own inside another room's folder (module -> room).
SUBROOMS = {
    "realm_jax.interop.commands": "interop.commands",
    "realm_jax.sweep.trial": "sweep.trial",
}


def _room(module: str) -> str:
    for prefix, room in SUBROOMS.items():
        if module == prefix or module.startswith(prefix + "."):
            return room
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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle per strongly connected group of modules (Tarjan), as a path."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_room_and_imports_point_down():
    bad = [v for module, path in _modules() for v in violations(module, module_imports(path))]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {module: module_imports(path) - {module} for module, path in _modules()}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_rule_catches_bad_imports():
    assert violations("realm_jax.index.feed", {"realm_jax.pretrain.step"})  # upward
    assert violations("realm_jax.ict.step", {"realm_jax.pretrain.losses"})  # task -> task
    assert violations("realm_jax.model.realm", {"realm_jax.ops.mips"})  # sibling rooms
    assert violations("realm_jax.interop.hf_import", {"realm_jax.model.bert"})  # formats: low
    assert violations("realm_jax.data.prepare", {"realm_jax.interop.commands"})  # the command
    assert not violations("realm_jax.pretrain.step", {"realm_jax.index.embedding"})
    assert not violations("realm_jax.data.prepare", {"realm_jax.interop.block_records"})
    assert not violations("realm_jax.interop.commands", {"realm_jax.index.store"})
    assert not violations("realm_jax.interop.commands", {"realm_jax.interop.hf_import"})
    assert not violations("realm_jax.train.loop", {"realm_jax.sweep.trial"})  # a foundation
    assert violations("realm_jax.train.loop", {"realm_jax.sweep.points"})  # the sweep: on top
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not cycles({"a": {"b"}, "b": {"c"}, "d": {"a"}})
