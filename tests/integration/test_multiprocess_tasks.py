"""ICT and open-domain QA as 2 jax.distributed processes x 2 fake CPU devices, through the CLI,
against the same runs as 1 process x 4 devices (the independent reference): the same global
batches (data/pipeline.py) and the same losses; the held-out evaluations, `evaluate` and `ask`
gather the index and predictions across processes (sharding.to_host) and give the same
numbers; only process 0 prints and writes. Also: sharding.to_host / broadcast_text under 2
processes, and a process count that does not divide the batch (one line, exit 2).

Where the two runs differ at all it is in the order of the cross-process gradient sums: the
tiny ICT model's gradient cancels so much that its norm moves by a few 1e-4 with the reduction
order (one process on 1, 2 or 4 devices differs as much), so ICT's gradient norms are compared
to 1e-3 and its held-out recall after training to one query; the losses agree to 1e-5, and
fine-tuning (its query embedder frozen here) gives the same numbers."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from realm_jax import workdir as paths
from realm_jax.data import prepare
from realm_jax.train.metrics import read_scalars
from tests.conftest import REPO
from tests.support.realm_fixtures import TINY_NETWORKS
from tests.support.runs import QA_OVERRIDES

ICT = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.masking=random",
    "model.proj_dropout=0",
    "train.batch_size=8",
    "train.steps=4",
    "train.warmup_steps=0",
    "train.lr=1e-4",  # a few steps move the tiny embedders little: the recalls stay comparable
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.eval_every=2",
    "train.eval_examples=32",
]
QA_STEPS = ("train.steps", "train.checkpoint_every", "train.eval_every", "train.warmup_steps")
QA = [o for o in QA_OVERRIDES if not o.startswith(QA_STEPS)] + [
    "train.steps=4",
    "train.warmup_steps=0",
    "train.checkpoint_every=2",
    "train.eval_every=2",
]
QUESTIONS = 16  # tests/test_qa_finetune.py's question file

WORKER = r"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from realm_jax import sharding
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
x = sharding.put_rows(rows, mesh)
assert not x.is_fully_addressable
try:
    jax.device_get(x)
    raise AssertionError("device_get of a row-sharded array should fail on 2 processes")
except RuntimeError as e:
    assert "non-addressable" in str(e)
tree = sharding.to_host({"rows": x, "rep": jax.device_put(rows, NamedSharding(mesh, P())),
                         "host": rows[:2]})
assert np.array_equal(tree["rows"], rows) and np.array_equal(tree["rep"], rows)
assert np.array_equal(tree["host"], rows[:2])
text = sharding.broadcast_text("ständig\n" if pid == 0 else "")
assert text == "ständig\n", text
assert sharding.broadcast_text("" if pid == 0 else "x") == ""
print("WORKER OK", flush=True)
jax.distributed.shutdown()
"""


SWAP_WORKER = r"""
import os, sys
sys.path.insert(0, os.getcwd())
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from realm_jax import sharding
from realm_jax.index import store
from realm_jax.index.feed import IndexFeed
from realm_jax.model.realm import realm_model
from tests.support.realm_fixtures import synthetic_index, tiny_config
config = tiny_config("refresh.mode=external", "refresh.wait_seconds=30")
mesh = sharding.make_mesh(config.mesh)
emb, tokens = synthetic_index(config)
workdir = os.environ["SWAP_WORKDIR"]
if pid == 0:
    store.publish_index(os.path.join(workdir, "index"), 3, emb, block_rows=8)
sharding.broadcast_text("published")
feed = IndexFeed(config, workdir, mesh, realm_model(config.model), tokens)
feed.start(None, 3)
got = sharding.to_host(feed.emb)
assert feed.step == 3 and np.array_equal(got[: len(emb)], emb) and not got[len(emb):].any()
print(f"SWAP {pid} {feed.last_swap_bytes}", flush=True)
# a newer version read beside the steps (refresh.background_reads): every process swaps at
# the same look, the first at which both have read their rows
if pid == 0:
    store.publish_index(os.path.join(workdir, "index"), 5, emb[::-1].copy(), block_rows=8)
sharding.broadcast_text("published 5")
import time
for step in range(4, 400):
    if feed.maybe_refresh(None, step):
        break
    time.sleep(0.05)
got = sharding.to_host(feed.emb)
assert feed.step == 5 and np.array_equal(got[: len(emb)], emb[::-1]), feed.step
print(f"SWAP5 {pid} {step}", flush=True)
# publish by row ranges: each process writes only its devices' rows; nothing of the matrix is
# gathered (every process_allgather is of one flag, no to_host)
from jax.experimental import multihost_utils
real_gather = multihost_utils.process_allgather
def small_gather(x, *a, **k):
    assert np.size(x) == 1, f"gathered {np.shape(x)}"
    return real_gather(x, *a, **k)
multihost_utils.process_allgather = small_gather
sharding.to_host = None
mine = sharding.owned_row_shards(feed.emb)
print("WROTE", pid, [(a, a + len(r)) for a, r in mine], flush=True)
path = store.publish_rows(os.path.join(workdir, "index"), 11, mine, len(emb), 128, block_rows=8)
assert np.array_equal(store.load_embeddings(path), emb[::-1])
# a process that cannot write its rows: both processes raise, naming it, neither waits
real_write = store.write_part
def broken(*a, **k):
    raise OSError("disk full (injected)")
store.write_part = broken if pid == 1 else real_write
try:
    store.publish_rows(os.path.join(workdir, "index"), 12, mine, len(emb), 128)
    raise AssertionError("published without process 1's rows")
except OSError as e:
    assert "process(es) [1]" in str(e), e
assert 12 not in store.list_versions(os.path.join(workdir, "index"))
print(f"ROWS {pid} OK", flush=True)
jax.distributed.shutdown()
"""


def _start(argv: list[str], processes: int, log: str, stdin: str = "") -> list[subprocess.Popen]:
    """`argv` (a command line after `python`) on 4 fake CPU devices in all: one process, or
    `processes` jax.distributed processes on loopback (4 / processes devices each). Output
    goes to `log`.<process>; `stdin` is written to process 0 (the others read nothing)."""
    import portpicker

    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    port = portpicker.pick_unused_port()
    procs = []
    for i in range(processes):
        dist = ["--cpu_devices", str(4 // processes)]
        if processes > 1:
            dist += ["--coordinator", f"127.0.0.1:{port}", "--num_processes", str(processes)]
            dist += ["--process_id", str(i)]
        if argv[0] == "-c":  # the to_host worker: its own arguments
            dist = [str(port), str(i)]
        with open(f"{log}.{i}", "wb") as out:
            p = subprocess.Popen(
                [sys.executable, *argv, *dist],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE if i == 0 and stdin else subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        if i == 0 and stdin:
            p.stdin.write(stdin.encode())
            p.stdin.close()
        procs.append(p)
    return procs


def _wait(runs: dict[str, tuple[list[subprocess.Popen], str]], codes=(0,)) -> dict[str, list]:
    """Wait for every process of every run ({name: (processes, log)}); each run's outputs,
    one per process. A process still running after a failure is killed (a jax.distributed
    peer would wait for a dead one)."""
    procs = [p for ps, _ in runs.values() for p in ps]
    out = {}
    try:
        for name, (ps, log) in runs.items():
            for p in ps:
                p.wait(timeout=400)
            out[name] = [open(f"{log}.{i}").read() for i in range(len(ps))]
            for i, p in enumerate(ps):
                assert p.returncode in codes, f"{name} process {i}:\n{out[name][i][-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _cli(command: str, config: str, workdir: str, overrides: list[str], *extra: str) -> list:
    return [
        *("-m", "realm_jax", command, "--config", config, "--workdir", workdir),
        *[f"--config.{o}" for o in overrides],
        *extra,
    ]


def _pair(tmp_path, name: str, argv_for, stdin: str = "") -> dict[str, list[str]]:
    """The same command as 1 process x 4 devices ("one") and 2 x 2 ("two"), side by side.
    argv_for(run name) -> the command line."""
    runs = {}
    for run, n in (("one", 1), ("two", 2)):
        log = str(tmp_path / f"{name}-{run}")
        runs[run] = (_start(argv_for(run), n, log, stdin), log)
    return _wait(runs)


def _console(text: str) -> list[str]:
    """The console's step and eval lines (what only process 0 prints)."""
    return [line for line in text.splitlines() if line.startswith(("step ", "eval "))]


def _compare_scalars(one: dict, two: dict, keys: tuple[str, ...]) -> None:
    """Every logged step of each key in `keys`: the same steps, values within 1e-5."""
    for key in keys:
        assert sorted(one[key]) == sorted(two[key]), key
        got = [two[key][s] for s in sorted(one[key])]
        want = [one[key][s] for s in sorted(one[key])]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)


def test_to_host_gathers_a_row_sharded_array_on_two_processes(tmp_path):
    """Under 2 processes x 2 devices, device_get of a row-sharded array fails and to_host
    returns the numpy array it was built from (a replicated one and host arrays too);
    broadcast_text hands process 0's text to both."""
    out = _wait({"w": (_start(["-c", WORKER], 2, str(tmp_path / "w")), str(tmp_path / "w"))})
    assert all("WORKER OK" in o for o in out["w"]), out


def test_a_swap_reads_only_the_rows_of_the_hosts_devices(tmp_path, monkeypatch):
    """Two trainer processes x 2 devices take up a published index: each reads (and checks
    by their sha256) only the row blocks its own devices hold, about half the matrix, and the
    row-sharded index they build together equals the published one (61 blocks padded to 64:
    16 rows a device, blocks of 8 rows; process 0 holds rows 0-31, process 1 rows 32-63 of
    which 32-60 exist); a newer version read beside the steps is swapped in by both processes
    at the same look. Then both publish it by row ranges (store.publish_rows): each writes only
    its devices' rows, no collective gathers more than a flag, the version reads back equal;
    a process that cannot write makes both raise, naming it."""
    monkeypatch.setenv("SWAP_WORKDIR", str(tmp_path / "work"))
    log = str(tmp_path / "swap")
    out = _wait({"swap": (_start(["-c", SWAP_WORKER], 2, log), log)})["swap"]
    read = {
        int(line.split()[1]): int(line.split()[2])
        for o in out
        for line in o.splitlines()
        if line.startswith("SWAP ")
    }
    row = 128 * 4  # bytes of one 128-dimensional float32 row
    assert read == {0: 32 * row, 1: (61 - 32) * row}, out
    # the newer version, read in the background, is swapped in by both at the same look
    swapped = {
        line.split()[1]: line.split()[2]
        for o in out
        for line in o.splitlines()
        if line.startswith("SWAP5 ")
    }
    assert len(swapped) == 2 and len(set(swapped.values())) == 1, out
    # publish by row ranges: each process wrote the rows of its own devices (16 a device)
    wrote = [line for o in out for line in o.splitlines() if line.startswith("WROTE ")]
    assert sorted(wrote) == ["WROTE 0 [(0, 16), (16, 32)]", "WROTE 1 [(32, 48), (48, 64)]"]
    assert all(f"ROWS {pid} OK" in out[pid] for pid in (0, 1)), out


@pytest.fixture(scope="module")
def ict_data(tmp_path_factory):
    """The bundled sample prepared for the tiny ICT runs (its held-out titles give the
    evaluation's sentences)."""
    root = tmp_path_factory.mktemp("ict")
    ddir = str(root / "prepared")
    from realm_jax.config import load_config

    cfg = load_config(os.path.join(REPO, "configs", "ict.py") + ":smoke", ICT)
    prepare.prepare(cfg, ddir)
    return ddir


@pytest.mark.system  # CI: 2 processes = 1 in the train step (test_train_step.py), the refresh
# job (test_trainer.py) and the sharded reads (test_shard_reads.py); ICT's loss over every
# device's negatives (test_ict.py)
def test_two_process_ict_matches_one_process(ict_data, tmp_path):
    """`ict` with its held-out evaluation on: 2 processes train on the same global batches
    as 1 (the same losses), evaluate recall@k over the whole corpus (gathered) to the same
    numbers, and only process 0 prints and writes metrics.json."""
    work = {run: str(tmp_path / run) for run in ("one", "two")}
    over = ICT + [f"data.data_dir={ict_data}"]
    out = _pair(tmp_path, "ict", lambda run: _cli("ict", "configs/ict.py:smoke", work[run], over))
    one, two = read_scalars(work["one"]), read_scalars(work["two"])
    assert sorted(one["loss"]) == [1, 2, 3, 4] and sorted(one["eval/recall_at_5"]) == [0, 2, 4]
    _compare_scalars(one, two, ("loss", "accuracy", "eval/examples", "eval/bm25_recall_at_20"))
    np.testing.assert_allclose(
        [two["grad_norm"][s] for s in range(1, 5)],
        [one["grad_norm"][s] for s in range(1, 5)],
        rtol=1e-3,  # the gradient's cross-process sum, in another order (module docstring)
    )
    recalls = [k for k in one if k.startswith("eval/recall_at_")]
    for k in recalls:  # step 0: the same parameters, so exactly the same ranking
        assert one[k][0] == two[k][0], k
        for s in (2, 4):  # within one query of 32 after a few steps
            assert abs(one[k][s] - two[k][s]) <= 1 / 32 + 1e-9, (k, s, one[k][s], two[k][s])
    assert _console(out["one"][0]) and len(_console(out["two"][0])) == len(_console(out["one"][0]))
    assert _console(out["two"][1]) == []  # process 1 prints no console lines
    final = [json.load(open(paths.metrics_path(work[r]))) for r in ("one", "two")]
    assert final[0]["step"] == final[1]["step"] == 4 and "recall@5" in final[1]["eval"]


@pytest.mark.system  # 2 + 1 process fine-tuning: CI keeps 1-process fine-tuning
def test_two_process_finetune_evaluate_and_ask_match_one_process(qa_files, tmp_path):
    """`finetune` (dev evaluation on), `evaluate` and `ask` as 2 processes: the losses and
    the dev exact match of the 1-process run, the same predictions file, written once (by
    process 0), and `ask` on stdin answering as `evaluate` predicted, printed by process 0."""
    root, ddir = qa_files
    work = {run: str(tmp_path / run) for run in ("one", "two")}
    over = QA + [
        f"data.corpus={root / 'corpus.jsonl'}",
        f"data.data_dir={ddir}",
        f"qa.train_file={root / 'qa.jsonl'}",
        f"qa.dev_file={root / 'qa.jsonl'}",
    ]

    def cli(command: str, *extra: str):
        return lambda run: _cli(command, "configs/orqa.py:smoke", work[run], over, *extra)

    _pair(tmp_path, "finetune", cli("finetune"))
    one, two = read_scalars(work["one"]), read_scalars(work["two"])
    assert sorted(one["eval/exact_match"]) == [0, 2, 4]
    keys = ("loss", "reader_loss", "retriever_loss", "eval/exact_match", "eval/recall_at_4")
    _compare_scalars(one, two, keys)

    out = _pair(tmp_path, "evaluate", cli("evaluate", "--limit", str(QUESTIONS)))
    assert "wrote " in out["two"][0] and "wrote " not in out["two"][1]
    metrics, preds = {}, {}
    for run in ("one", "two"):
        path = os.path.join(paths.eval_dir(work[run]), "qa.dense")
        metrics[run] = json.load(open(path + ".metrics.json"))
        preds[run] = [json.loads(line) for line in open(path + ".predictions.jsonl")]
    assert len(preds["two"]) == metrics["two"]["questions"] == QUESTIONS
    for k in ("exact_match", "recall@1", "recall@2", "recall@4"):
        assert metrics["one"][k] == metrics["two"][k], k
    assert [p["prediction"] for p in preds["one"]] == [p["prediction"] for p in preds["two"]]

    questions = [p["question"] for p in preds["two"][:2]]
    stdin = "".join(q + "\n" for q in questions) + "\n"
    log = str(tmp_path / "ask")
    out = _wait({"ask": (_start(cli("ask")("two"), 2, log, stdin), log)})["ask"]
    answers = [line for line in out[0].splitlines() if line.startswith("answer: ")]
    assert [a.split("  (from")[0] for a in answers] == [
        f"answer: {p['prediction']!r}" for p in preds["two"][:2]
    ], out[0][-2000:]
    assert "answer: " not in out[1]


def test_a_process_count_that_does_not_divide_the_batch_is_one_line(ict_data, tmp_path):
    """A global batch of 3 on a (1, 4) mesh fits the data axis but not 2 processes: every
    process stops with one error line and exit 2, before any work."""
    over = ICT + [f"data.data_dir={ict_data}", "train.batch_size=3", "mesh.shape=(1,4)"]
    log = str(tmp_path / "bad")
    argv = _cli("ict", "configs/ict.py:smoke", str(tmp_path / "w"), over)
    out = _wait({"bad": (_start(argv, 2, log), log)}, codes=(2,))["bad"]
    for text in out:
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        assert errors == [
            "realm-jax ict: error: train.batch_size 3 is not divisible by the job's 2 processes "
            "(each reads an equal share); change train.batch_size or the process count"
        ], text
        assert "Traceback" not in text
