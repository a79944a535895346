"""Every path a user gives may be gs://, against fake-gcs-server (tests/support/fake_gcs.py): warm
starts from a REALM workdir's checkpoints (model.init_from_realm, the ICT embedder restore),
HuggingFace weight folders (copied once per host into the local cache, concurrent copies
safe), question and predictions files, `evaluate`'s outputs, a sweep's table and plots, and
the one-line errors (exit 2) for a bucket that does not exist or cannot be reached and a gs://
workdir without checkpoints."""

import argparse
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from realm_jax import checkpoint, fs, sharding
from realm_jax import workdir as paths
from realm_jax.config import load_config
from tests.conftest import REPO
from tests.support import fake_gcs
from tests.support.realm_fixtures import TINY_NETWORKS

BUCKET = "realm-test"
ROOT = f"gs://{BUCKET}"
ORQA = os.path.join(REPO, "configs", "orqa.py")
REALM = os.path.join(REPO, "configs", "realm.py")
TITLES = ("Materialism", "Political philosophy")  # two small articles of data/sample
# A 1 x 32 BERT (TINY_NETWORKS) over the bundled sample's two articles, no dropout.
QA_OVERRIDES = TINY_NETWORKS + [
    "model.span_hidden_size=16",
    "model.proj_dropout=0",
    "data.block_len=64",
    "data.query_len=24",
    "data.max_predictions=5",
    "data.masking=random",
    "data.eval_fraction=0.0",
    "qa.train_holdout=none",
    "qa.dev_holdout=none",
    "qa.retriever_beam_size=16",
    "qa.reader_beam_size=3",
    "qa.recall_ks=(1,2,4)",
    "train.batch_size=8",
    "train.eval_batch_size=8",
    "refresh.build_scann=False",
]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server for the module (tests/support/fake_gcs.py: environment and cache set)."""
    with fake_gcs.module_server(tmp_path_factory, BUCKET) as server:
        yield server


def _qa_config(*extra):
    return load_config(f"{ORQA}:smoke", QA_OVERRIDES + list(extra))


def _random_params(config, names, seed: int = 0) -> dict:
    """{network: random host params} shaped as this config's networks (no init compiled)."""
    from realm_jax.index.embedding import abstract_params

    mesh, rng = sharding.make_mesh(config.mesh), np.random.default_rng(seed)
    out = {}
    for name in names:
        _, target = abstract_params(config, mesh, name)
        out[name] = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), target)
    return out


@pytest.fixture(scope="module")
def qa_run(gcs, tmp_path_factory):
    """A fine-tuning workdir on gs:// as `finetune` leaves it: prepared data, questions, a
    best/ checkpoint (random params: the reference for what is read back) and a published
    frozen index (random embeddings)."""
    from realm_jax.data import prepare
    from realm_jax.index import store

    local = tmp_path_factory.mktemp("qa")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        (local / "corpus.jsonl").write_text(
            "".join(line for line in f if json.loads(line)["title"] in TITLES)
        )
    with open(os.path.join(REPO, "data", "sample", "qa.jsonl")) as f:
        questions = [line for line in f if json.loads(line)["title"] in TITLES][:12]
    work, qfile = f"{ROOT}/qa/run", f"{ROOT}/qa/questions.jsonl"
    fs.write_text(qfile, "".join(questions))
    config = _qa_config(
        f"data.corpus={local / 'corpus.jsonl'}",
        f"data.data_dir={ROOT}/qa/data",
        f"qa.train_file={qfile}",
        f"qa.dev_file={qfile}",
    )
    prepare.prepare(config, config.data.data_dir)
    params = _random_params(config, ("query_embedder", "reader"))
    best = checkpoint.best_manager(paths.best_dir(work), "exact_match")
    checkpoint.save_params(best, 7, params, {"exact_match": 0.5})
    best.wait_until_finished()
    num_blocks = json.loads(fs.read_bytes(f"{ROOT}/qa/data/summary.json"))["counts"]["blocks"]
    emb = np.random.default_rng(1).normal(size=(num_blocks, config.model.proj_size))
    store.publish_index(paths.index_dir(work), 0, emb.astype(np.float32))
    return config, work, qfile, params, [json.loads(q) for q in questions]


def _eval_args(work: str, **kw) -> argparse.Namespace:
    """`evaluate`'s parsed arguments (cli.py's defaults) with `kw` changed."""
    args = dict(questions="", format="auto", limit=0, predictions="", retrieval_only=False)
    args.update(output="", checkpoint="best", retriever="dense", config=f"{ORQA}:smoke")
    return argparse.Namespace(workdir=work, **{**args, **kw})


def test_evaluate_reads_a_gcs_workdir_and_questions_and_writes_there(
    qa_run, capsys, tmp_path, monkeypatch
):
    """The best checkpoint restored from gs:// is the one saved; the predictions and metrics
    land on gs:// (default prefix and --output), and --predictions rescores them from there."""
    from realm_jax.qa import commands as qa_commands

    config, work, qfile, params, questions = qa_run
    monkeypatch.chdir(tmp_path)  # where a mangled URL would land as a local "gs:" folder
    mesh = sharding.make_mesh(config.mesh)
    _, restored, step, where = qa_commands.restore_reader(config, work, mesh)
    assert (step, where) == (7, "best")
    for name in ("query_embedder", "reader"):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored[name]), params[name])

    out = f"{ROOT}/qa/elsewhere/dense"
    assert qa_commands.evaluate(config, _eval_args(work, questions=qfile, output=out)) == 0
    metrics = json.loads(fs.read_bytes(out + ".metrics.json"))
    preds = [json.loads(x) for x in fs.read_text(out + ".predictions.jsonl").splitlines()]
    assert [p["question"] for p in preds] == [q["question"] for q in questions]
    assert metrics["questions"] == len(questions) and metrics["questions_file"] == qfile
    assert metrics["exact_match"] == np.mean([p["correct"] for p in preds])
    assert metrics["model"] == f"best checkpoint 7 of {work}"

    args = _eval_args(work, retriever="bm25", retrieval_only=True)
    assert qa_commands.evaluate(config, args) == 0  # the config's dev file, default prefix
    default = f"{work}/eval/questions.bm25-retrieval"
    assert sorted(fs.listdir(f"{work}/eval")) == [
        "questions.bm25-retrieval.metrics.json",
        "questions.bm25-retrieval.predictions.jsonl",
    ]
    alone = json.loads(fs.read_bytes(default + ".metrics.json"))
    assert alone["model"] == "no model (retrieval alone)" and alone["questions"] == len(questions)

    capsys.readouterr()
    args = _eval_args(work, questions=qfile, predictions=out + ".predictions.jsonl")
    assert qa_commands.evaluate(config, args) == 0
    assert f"accuracy {metrics['exact_match']:.4f}" in capsys.readouterr().out

    # the Python API on the same gs:// workdir: its answers are evaluate's predictions
    import realm_jax

    over = [*QA_OVERRIDES, f"data.data_dir={ROOT}/qa/data", f"qa.dev_file={qfile}"]
    model = realm_jax.load(work, config=f"{ORQA}:smoke", overrides=over)
    got = model.answer([p["question"] for p in preds[:4]])
    assert [a.text for a in got] == [p["prediction"] for p in preds[:4]]
    assert [[h.block_id for h in a.evidence] for a in got] == [
        [b["id"] for b in p["top_blocks"]] for p in preds[:4]
    ]
    hits = model.retrieve(preds[0]["question"], k=len(preds[0]["top_blocks"]))
    assert [h.block_id for h in hits] == [b["id"] for b in preds[0]["top_blocks"]]
    assert os.listdir(tmp_path) == []


def test_question_files_on_gcs_read_as_local_ones(gcs, tmp_path):
    """Every format and the auto detection, from gs:// and from a local copy of the same
    bytes; a missing gs:// file is named."""
    from realm_jax.qa import answers

    files = {
        "q.jsonl": '{"question": "who?", "answer": ["Plato"]}\n',
        "s.jsonl": '{"question": "what?", "answers": ["x"], "title": "T"}\n',
        "w.json": '[{"qId": "1", "qText": "when?", "answers": ["1999"]}]',
        "t.tsv": "1\tfactoid\twhere?\tAth(ens|en)\n",
    }
    for name, text in files.items():
        fs.write_text(f"{ROOT}/questions/{name}", text)
        (tmp_path / name).write_text(text)
        remote = answers.read_questions(f"{ROOT}/questions/{name}")
        here = answers.read_questions(str(tmp_path / name))
        assert [(e.question, e.answers, e.is_regex, e.title) for e in remote] == [
            (e.question, e.answers, e.is_regex, e.title) for e in here
        ]
        url = f"{ROOT}/questions/{name}"
        assert remote[0].source == (f"{url}: entry 0" if name == "w.json" else f"{url}:1")
    with pytest.raises(FileNotFoundError, match=f"{ROOT}/questions/none.jsonl"):
        answers.read_questions(f"{ROOT}/questions/none.jsonl")
    fs.write_text(f"{ROOT}/questions/p.jsonl", '{"question": "who?", "prediction": "Plato"}\n')
    assert answers.read_predictions(f"{ROOT}/questions/p.jsonl") == {"who?": "Plato"}


# ------------------------------------------------------------------ warm starts, HF folders


def _hf_bert(path: str, config, seed: int = 2) -> dict[str, np.ndarray]:
    """A BertModel folder (config.json + model.safetensors) shaped as config.model.embedder,
    written to `path` (local or gs://); returns its tensors."""
    from safetensors.numpy import save

    e = config.model.embedder
    h, inter, vocab = e.hidden_size, e.intermediate_size, config.model.vocab_size
    linear = {"pooler.dense": (h, h)}  # HF stores [out, in]
    norms = ["embeddings.LayerNorm"]
    for i in range(e.num_layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            linear[f"{p}attention.self.{name}"] = (h, h)
        linear[f"{p}attention.output.dense"] = (h, h)
        linear[f"{p}intermediate.dense"] = (inter, h)
        linear[f"{p}output.dense"] = (h, inter)
        norms += [f"{p}attention.output.LayerNorm", f"{p}output.LayerNorm"]
    shapes = {
        "embeddings.word_embeddings.weight": (vocab, h),
        "embeddings.position_embeddings.weight": (e.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (e.type_vocab_size, h),
    }
    shapes |= {f"{k}.weight": shape for k, shape in linear.items()}
    shapes |= {f"{k}.bias": shape[:1] for k, shape in linear.items()}
    shapes |= {f"{k}.{w}": (h,) for k in norms for w in ("weight", "bias")}
    rng = np.random.default_rng(seed)
    tensors = {k: rng.normal(size=v).astype(np.float32) for k, v in shapes.items()}
    hf = {
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": h,
        "num_hidden_layers": e.num_layers,
        "num_attention_heads": e.num_heads,
        "intermediate_size": inter,
        "hidden_act": e.hidden_act,
        "max_position_embeddings": e.max_position_embeddings,
        "type_vocab_size": e.type_vocab_size,
        "layer_norm_eps": e.layer_norm_eps,
    }
    fs.write_text(fs.join(path, "config.json"), json.dumps(hf))
    fs.write_bytes(fs.join(path, "model.safetensors"), save(tensors))
    return tensors


@pytest.fixture(scope="module")
def realm_run(gcs):
    """A REALM pre-training workdir on gs:// with one checkpoint (step 3) of random params of
    all three networks (the reference), and a BertModel folder on gs:// for the embedders."""
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name

    realm = load_config(
        f"{REALM}:smoke", TINY_NETWORKS + ["data.block_len=64", "data.query_len=24"]
    )
    doc = doc_embedder_name(ModelConfig.from_config(realm.model, "embedder"))
    params = _random_params(realm, ("query_embedder", doc, "reader"), seed=3)
    work = f"{ROOT}/realm/run"
    mgr = checkpoint.manager(work, with_data=False)
    checkpoint.save(mgr, 3, {"params": params}, force=True)
    mgr.wait_until_finished()
    hf = f"{ROOT}/hf/tiny-bert"
    return work, params, hf, _hf_bert(hf, realm)


def test_warm_start_reads_realm_and_hf_weights_from_gcs(realm_run):
    """model.init_from_realm (all three networks; the span head keeps its fresh values) and
    model.init_embedder_from (both embedders, after) from gs://, through params_hook as a
    run's initialisation calls it; and an ICT-style embedder restore from the same workdir."""
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name
    from realm_jax.train import warm_start

    work, saved, hf, tensors = realm_run
    config = _qa_config(f"model.init_from_realm={work}", f"model.init_embedder_from={hf}")
    ecfg = ModelConfig.from_config(config.model, "embedder")
    names = ("query_embedder", doc_embedder_name(ecfg), "reader")
    fresh = _random_params(config, names, seed=4)
    got = warm_start.params_hook(config, span_head=True)(fresh)
    for name in names[:2]:
        bert = got[name]["bert"]
        want = tensors["embeddings.word_embeddings.weight"]
        np.testing.assert_array_equal(bert["embeddings"]["word_embeddings"]["embedding"], want)
        np.testing.assert_array_equal(
            bert["layer_0"]["intermediate"]["kernel"],
            tensors["encoder.layer.0.intermediate.dense.weight"].T,
        )
        # not in a BertModel: the projection comes from the REALM checkpoint
        np.testing.assert_array_equal(
            got[name]["projection"]["kernel"], saved[name]["projection"]["kernel"]
        )
    reader = {k: v for k, v in got["reader"].items() if k != "span"}
    jax.tree.map(np.testing.assert_array_equal, reader, {k: saved["reader"][k] for k in reader})
    jax.tree.map(np.testing.assert_array_equal, got["reader"]["span"], fresh["reader"]["span"])

    ict = warm_start.ict_embedder_params(work, ecfg)  # the restore ICT warm starts use
    for name in ict:
        jax.tree.map(np.testing.assert_array_equal, ict[name], saved[name])


def test_hf_folder_on_gcs_is_copied_once_into_the_cache(realm_run, gcs):
    """A gs:// weights folder is read from one verified local copy, made once per host;
    rewritten, it is copied afresh; a local folder is read in place."""
    from realm_jax.interop import hf_import as weights

    _, _, hf, tensors = realm_run
    first = weights.local_folder(hf)
    assert first.startswith(fs.cache_root()) and sorted(os.listdir(first)) == [
        ".complete",
        "config.json",
        "model.safetensors",
    ]
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    _, loaded = weights.read_hf_folder(hf)
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k], v)
    assert weights.local_folder(hf) == first  # the same copy, not downloaded again
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert weights.local_folder(first) == first  # local: in place

    moved = f"{ROOT}/hf/rewritten"
    for name in ("config.json", "model.safetensors"):
        fs.write_bytes(fs.join(moved, name), fs.read_bytes(fs.join(hf, name)))
    copy = weights.local_folder(moved)
    assert copy != first
    fs.write_bytes(fs.join(moved, "vocab.txt"), b"[PAD]\n")  # rewritten: a new copy, vocab too
    again = weights.local_folder(moved)
    assert again != copy and open(os.path.join(again, "vocab.txt")).read() == "[PAD]\n"
    leftovers = [n for n in os.listdir(os.path.dirname(first)) if "." in n]
    assert leftovers == []  # no temp or stale folder left beside the copies

    fs.remove(fs.join(moved, "model.safetensors"))
    with pytest.raises(weights.WeightImportError, match=f"{moved}: no model.safetensors"):
        weights.read_hf_folder(moved)
    with pytest.raises(weights.WeightImportError, match="no-such-bucket"):
        weights.check_folder("gs://no-such-bucket/model")


RACE = """
import sys, time
from realm_jax import fs
src, local, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
files = {name: fs.size(fs.join(src, name)) for name in ("config.json", "model.safetensors")}
time.sleep(max(0.0, start - time.time()))  # every process downloads at once
print(fs.cached_copy(src, files, local))
"""


def test_concurrent_copies_on_one_host_never_corrupt_the_cache(realm_run, tmp_path):
    """Four processes copying the same folder at the same moment: each gets a whole copy at
    the same path (the first rename wins), and nothing else is left in the cache folder."""
    import time

    _, _, hf, _ = realm_run
    local = str(tmp_path / "cache" / "hf" / "one")
    os.makedirs(local)  # an older layout's folder without its marker: replaced
    start = str(time.time() + 4)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, hf, local, start],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-2000:] for _, e in outs]
    assert {o.strip() for o, _ in outs} == {local}
    assert sorted(os.listdir(tmp_path / "cache" / "hf")) == ["one"]
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(local, name), "rb") as f:
            assert f.read() == fs.read_bytes(fs.join(hf, name))


# ------------------------------------------------------------------------------------ sweeps


def test_a_sweep_table_under_a_gcs_prefix(gcs, tmp_path, monkeypatch, capsys):
    """`sweep --table gs://...`: the trials' metrics.json read from the bucket, sweep.md,
    sweep.csv and the plots written there (a study in a local SQLite file standing for the
    sweep's database server); a gs:// prefix without a database server is one line, exit 2."""
    import optuna

    from realm_jax import cli
    from realm_jax.sweep import storage

    monkeypatch.chdir(tmp_path)  # nothing may be written to a local "gs:" folder
    url = f"sqlite:///{tmp_path}/study.db"
    study = optuna.create_study(storage=storage.open_storage(url, create=True), study_name="lr")
    study.set_user_attr("realm_jax", {"spec": f"{REALM}:smoke", "extra": [], "task": "realm",
                                      "kind": "grid", "objective": "eval/accuracy"})  # fmt: skip
    prefix = f"{ROOT}/sweeps/lr"
    for lr, acc in ((0.001, 0.25), (0.002, 0.5)):
        t = study.ask()
        name = f"lr={lr}"
        t.set_user_attr("name", name)
        t.set_user_attr("workdir", f"{prefix}/{name}")
        t.report(acc / 2, 0)
        metrics = {"step": 4, "steps": 4, "complete": True, "train": {"loss": 1.5},
                   "eval_step": 4, "eval": {"accuracy": acc},
                   "console_keys": {"train": ["loss"], "eval": ["accuracy"]}}  # fmt: skip
        fs.write_text(f"{prefix}/{name}/metrics.json", json.dumps(metrics))
        study.tell(t, acc)
    rc = cli.main(["sweep", "--table", prefix + "/", "--storage", url, "--study", "lr"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert sorted(fs.listdir(prefix)) == ["lr=0.001", "lr=0.002", "plots", "sweep.csv", "sweep.md"]
    md = fs.read_text(f"{prefix}/sweep.md")
    assert "| 1 | lr=0.002 | COMPLETE | 0.5 | 4 | 1.5 | 4 | 0.5 |" in md
    assert f"--workdir {prefix}/best" in md and f"--workdir {prefix}/best" in out
    assert fs.read_bytes(f"{prefix}/plots/optimization_history.png")[:4] == b"\x89PNG"
    assert not os.path.exists(tmp_path / "gs:")

    rc = cli.main(["sweep", "--config", f"{REALM}:smoke", "--workdir", prefix])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "needs --storage naming a database server" in err


# ------------------------------------------------------------------------- one-line errors


def _cli(*args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_bad_gcs_paths_are_one_line_errors(qa_run):
    """Exit 2 and one line naming the path, before any model is built: a bucket that does not
    exist, a store that cannot be reached, gs:// workdirs without checkpoints for `evaluate`,
    `ask` and model.init_from_realm."""
    config, work, qfile, _, _ = qa_run
    empty = f"{ROOT}/qa/empty"
    orqa = ["--config", "configs/orqa.py:smoke"]
    tiny = [f"--config.{o}" for o in QA_OVERRIDES] + [
        f"--config.data.data_dir={config.data.data_dir}",
        f"--config.qa.train_file={qfile}",
        f"--config.qa.dev_file={qfile}",
    ]
    dead = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{fake_gcs.free_port()}"}
    cases = [
        (["train", "--workdir", "gs://no-such-bucket/run"], None,
         "gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist"),
        (["sweep", "--table", "gs://no-such-bucket/sweep", "--storage", "grpc://127.0.0.1:1"],
         None, "gs://no-such-bucket/sweep: bucket gs://no-such-bucket does not exist"),
        (["evaluate", *orqa, "--workdir", work, "--output", "gs://no-such-bucket/out"], None,
         "gs://no-such-bucket/out: bucket gs://no-such-bucket does not exist"),
        (["evaluate", *orqa, "--workdir", work], dead, f"{work}: cannot reach gs://{BUCKET}"),
        (["evaluate", *orqa, "--workdir", empty, "--questions", qfile], None,
         f"{empty}: no checkpoints"),
        (["ask", *orqa, "--workdir", empty, "who?"], None, f"{empty}: no checkpoints"),
        (["finetune", *orqa, "--workdir", f"{ROOT}/qa/ft", *tiny,
          f"--config.model.init_from_realm={empty}"], None,
         f"model.init_from_realm='{empty}': no checkpoints folder there"),
    ]  # fmt: skip
    procs = [(_cli(*args, env=env), args, message) for args, env, message in cases]
    for proc, args, message in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (args, err[-3000:])
        # one line; `finetune` logs its set-up (the data, the mesh) before the warm start
        lines = err.splitlines()
        assert len(lines) == 1 or args[0] == "finetune", (args, err[-3000:])
        assert lines[-1].startswith(f"realm-jax {args[0]}: error: "), (args, err[-3000:])
        assert message in lines[-1], (args, lines[-1])
