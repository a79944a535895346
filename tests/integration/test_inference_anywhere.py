"""A trained workdir answers on any host (issue 59): one whose checkpoint was saved from a
(2, 2) mesh on 4 devices loads in a process with one CPU device (realm_jax.load and `ask`)
and answers as on the 4 devices, with no third-party noise on the way; and the one validation
every entry point runs (realm_jax/validation.py): each bad question, k, retriever and
checkpoint one clear error, as docs/reliability.md's table of the Python API says."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import realm_jax
from realm_jax import api, checkpoint, sharding, validation
from realm_jax import workdir as paths
from realm_jax.config import load_config
from realm_jax.data import datasets
from realm_jax.index import store
from realm_jax.index.ask import one_line
from realm_jax.index.embedding import abstract_params
from tests.conftest import REPO
from tests.support.runs import QA_OVERRIDES, qa_config

ORQA = os.path.join(REPO, "configs", "orqa.py") + ":smoke"
QUESTIONS = ["What is materialism?", "Who was Plato?"]
# What a normal run must not print (issue 59): JAX's fork warning, orbax's read-only notices
# (through absl), TFDS's "Downloading" for data that downloads nothing, bm25s' DEBUG lines,
# progress bars' carriage returns and escape codes.
NOISE = (
    "os.fork()",
    "Given directory is read only",
    "read_only=True, setting",
    "Downloading and preparing",
    "bm25s:",
    "\r",
    "\x1b[",
)


@pytest.fixture(scope="module")
def mesh_workdir(qa_files, tmp_path_factory):
    """A fine-tuned workdir as `finetune --config.mesh.shape=(2,2)` on 4 devices leaves it: a
    best/ checkpoint saved from params sharded over the (2, 2) mesh (random, no training), a
    published frozen index (random), its config recorded. (workdir, overrides)."""
    root, ddir = qa_files
    work = str(tmp_path_factory.mktemp("mesh22") / "qa")
    over = [
        *QA_OVERRIDES,
        f"data.corpus={root / 'corpus.jsonl'}",
        f"data.data_dir={ddir}",
        f"qa.train_file={root / 'qa.jsonl'}",
        f"qa.dev_file={root / 'qa.jsonl'}",
        "mesh.shape=(2,2)",
    ]
    config = load_config(ORQA, over)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
    rng = np.random.default_rng(0)
    params = {}
    for name in ("query_embedder", "reader"):
        _, target = abstract_params(config, mesh, name)
        params[name] = jax.tree.map(
            lambda s: jax.device_put(rng.normal(0, 0.1, s.shape).astype(s.dtype), s.sharding),
            target,
        )
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.devices()} == set(mesh.devices.flat)
    best = checkpoint.best_manager(paths.best_dir(work), "exact_match")
    checkpoint.save_params(best, 7, params, {"exact_match": 0.5})
    best.wait_until_finished()
    blocks = datasets.load_summary(ddir)["counts"]["blocks"]
    emb = rng.normal(size=(blocks, config.model.proj_size)).astype(np.float32)
    store.publish_index(paths.index_dir(work), 0, emb)
    api.record_run_config(work, ORQA, over)
    return work, over


_ONE_DEVICE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
import realm_jax
from realm_jax import cli
assert jax.device_count() == 1, jax.devices()
m = realm_jax.load(sys.argv[1])
hits = m.retrieve({questions!r}, k=4)
answers = m.answer({questions!r})
print(json.dumps({{
    "mesh": [int(n) for n in m._mesh.devices.shape],
    "hits": [[[h.block_id, h.score] for h in row] for row in hits],
    "answers": [[a.text, a.score, [[h.block_id, h.score] for h in a.evidence]] for a in answers],
}}), flush=True)
import logging  # absl's first log gave root a WARNING handler: the CLI's own, as in its process
logging.root.handlers.clear()
sys.exit(cli.main(["ask", "--config", sys.argv[2], "--workdir", sys.argv[1], "--top_k", "3",
                   *["--config." + o for o in sys.argv[3:]], {question!r}]))
"""


def test_a_workdir_trained_on_a_2x2_mesh_answers_on_one_device(mesh_workdir):
    work, over = mesh_workdir
    model = realm_jax.load(work)  # this process: 4 devices, answer() on the (2, 2) mesh
    want_hits = model.retrieve(QUESTIONS, k=4)
    want = model.answer(QUESTIONS)
    assert model._predictors["dense"][0].mesh.devices.shape == (2, 2)

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"]
    )
    script = _ONE_DEVICE.format(questions=QUESTIONS, question=QUESTIONS[0])
    r = subprocess.run(
        [sys.executable, "-c", script, work, ORQA, *over],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=600,
    )  # bytes: text mode would turn a progress bar's carriage returns into newlines
    out, err = (b.decode("utf-8", "replace") for b in (r.stdout, r.stderr))
    assert r.returncode == 0, err[-3000:]
    first, shown = out.split("\n", 1)
    got = json.loads(first)
    assert got["mesh"] == [1, 1]  # the API's one device, the config's axes
    for row, want_row in zip(got["hits"], want_hits, strict=True):
        assert [i for i, _ in row] == [h.block_id for h in want_row]
        np.testing.assert_allclose([s for _, s in row], [h.score for h in want_row], rtol=1e-4)
    for (text, score, evidence), a in zip(got["answers"], want, strict=True):
        assert text == a.text and [i for i, _ in evidence] == [h.block_id for h in a.evidence]
        np.testing.assert_allclose(score, a.score, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            [s for _, s in evidence], [h.score for h in a.evidence], rtol=1e-4, atol=1e-4
        )

    # `ask` in the same process: one line says the mesh changed; each block read is shown
    # with its text (one line) and its retriever's score, as the 4-device answer has them
    assert (
        "mesh.shape (2, 2) needs 4 devices, the job has 1 here: answering on mesh.shape (1, 1)"
        in err
    ), err[-3000:]
    assert shown.startswith(f"answer: {want[0].text!r}"), shown
    rows = re.findall(r"^  \[\s*(-?[\d.]+)\] block (\d+): (.*)\n {13}(.*)$", shown, re.M)
    evidence = want[0].evidence[:3]
    assert [int(i) for _, i, _, _ in rows] == [h.block_id for h in evidence], shown
    for (score, _, title, text), h in zip(rows, evidence, strict=True):
        assert abs(float(score) - h.score) < 2e-3
        assert title == one_line(h.title, 80) and text == one_line(h.text)
    for noise in NOISE:
        assert noise not in out + err, (noise, err[-3000:])


def test_prepare_prints_no_third_party_noise(qa_files, tmp_path, capfd):
    """TFDS's builders download nothing here: no "Downloading and preparing dataset", no
    progress bars of its splits; our own bars only on a terminal (not in a captured log)."""
    from realm_jax.data import prepare

    root, _ = qa_files
    config = qa_config(root, str(tmp_path / "data"))
    prepare.prepare(config, config.data.data_dir)
    out, err = capfd.readouterr()
    assert "prepared " in out, out + err
    for noise in (*NOISE, "Generating splits", "Shuffling", "%|"):
        assert noise not in out + err, (noise, out + err)


# ------------------------------------------------------------------- the one validation


def _api_table() -> list[tuple[str, str, str]]:
    """(call, exception, message) rows of docs/reliability.md's Python API table."""
    with open(os.path.join(REPO, "docs", "reliability.md")) as f:
        text = f.read()
    part = text.split("<!-- api-errors:begin -->")[1].split("<!-- api-errors:end -->")[0]
    rows = re.findall(r"^\| `(.+?)` \| `(\w+)` \| `(.+?)` \|$", part, re.M)
    assert len(rows) >= 8, part
    return rows


def test_every_api_method_validates_as_the_docs_table_says(mesh_workdir):
    """Each row of the table, called on the workdir (`model` a loaded one): the exception and
    the message, raised before any network runs."""
    work, _ = mesh_workdir
    namespace = {"realm_jax": realm_jax, "model": realm_jax.load(work), "WORKDIR": work}
    for call, kind, message in _api_table():
        with pytest.raises(validation.InputError) as e:
            eval(call, namespace)  # noqa: S307 (the docs' own examples)
        assert type(e.value).__name__ == kind, call
        assert str(e.value) == message.replace("WORKDIR", work), call
    assert realm_jax.load(work, checkpoint=7)._manager()[1] == 7  # a step it holds
