"""The sweep tests' shared pieces: a config file of the test's own (a task config's variants and a
sweep() of its choosing), tiny ICT runs on the bundled sample's first passages, the workers on two
fake CPU devices, and the study's SQLite file read with sqlite3 (not Optuna)."""

import json
import os
import sqlite3

from tests.conftest import REPO
from tests.support.realm_fixtures import tiny_networks

ICT = os.path.join(REPO, "configs", "ict.py")
REALM = os.path.join(REPO, "configs", "realm.py")
# Tiny ICT runs (the cheapest trainer: one embedder, no reader) with a quarter of the passages'
# doc ids held out; a test adds its steps and evaluations.
ICT_COMMON = tiny_networks("embedder") + [
    "data.block_len=64",
    "data.query_len=32",
    "data.eval_split_key=doc_id",
    "data.eval_fraction=0.25",
    "train.batch_size=8",
]
WRAPPER = """
import importlib.util
from realm_jax.sweep import space

_spec = importlib.util.spec_from_file_location("config_for_sweep_test", {path!r})
_task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_task)


def get_config(arg=None):
    return _task.get_config(arg)


def sweep():
    return {body}
"""


def sweep_config(tmp_path, body: str, task: str = ICT, name: str = "sweep_config.py") -> str:
    """The path of a config file whose variants are `task`'s and whose sweep() returns `body`
    (Python source: a list of points, space.Grid or space.Search)."""
    path = tmp_path / name
    path.write_text(WRAPPER.format(path=task, body=body))
    return str(path)


def sample_corpus(tmp_path, passages: int = 60) -> str:
    """The bundled sample's first `passages` lines, as tmp_path/corpus.jsonl."""
    corpus = tmp_path / "corpus.jsonl"
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        corpus.write_text("".join(f.readlines()[:passages]))
    return str(corpus)


def two_device_flags(xla_flags: str) -> str:
    """XLA_FLAGS with 2 fake CPU devices (conftest's CHILD_DEVICES; the test process has more)."""
    flags = [f for f in xla_flags.split() if "device_count" not in f]
    return " ".join([*flags, "--xla_force_host_platform_device_count=2"])


def read_trials(prefix) -> dict[int, dict]:
    """{number: state, values, params, attrs (user, decoded), system (attrs, decoded), steps (of
    the intermediate values), start, end} from prefix/study.db, opened read-only (never makes
    the file)."""
    path = os.path.join(prefix, "study.db")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    out = {}
    rows = "SELECT trial_id, number, state, datetime_start, datetime_complete FROM trials"
    for tid, number, state, start, end in con.execute(rows):
        q = lambda sql, tid=tid: list(con.execute(f"{sql} WHERE trial_id={tid}"))  # noqa: E731
        out[number] = {
            "state": state,
            "values": [v for (v,) in q("SELECT value FROM trial_values")],
            "params": dict(q("SELECT param_name, param_value FROM trial_params")),
            "attrs": {
                k: json.loads(v) for k, v in q("SELECT key, value_json FROM trial_user_attributes")
            },  # fmt: skip
            "system": {
                k: json.loads(v)
                for k, v in q("SELECT key, value_json FROM trial_system_attributes")
            },  # fmt: skip
            "steps": sorted(s for (s,) in q("SELECT step FROM trial_intermediate_values")),
            "start": start,
            "end": end,
        }
    con.close()
    return out
