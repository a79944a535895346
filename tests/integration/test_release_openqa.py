"""The paper's released open-QA model through `import` -> `evaluate` -> `ask`, rehearsed on tiny
fixtures of the release's formats (tests/fixtures/release/, written by TensorFlow's Saver and
TFRecordWriter): docs/release.md's "Reproducing the paper's released models" commands, read from
that page and run with the gs:// paths mapped to local copies.

The fixture's words are 100 ids, and realm-jax's tokenizer speaks BERT's 30,522: the rehearsal's
copy of orqa_nq_model_from_realm keeps every fixture value and widens the two word-embedding
tables and MLM biases to 30,522 rows (written by tf_checkpoint.write_checkpoint, which
reproduces TensorFlow's bytes: test_tf_import.py). The reference for retrieval is independent of
realm-jax's model and name mapping: a numpy BERT over the checkpoint's TensorFlow variables
embeds the questions, and a brute-force MIPS over block_emb (as TensorFlow read it back) ranks
the blocks.
"""

import contextlib
import io
import json
import os
import re
import shlex
import shutil

import jax
import numpy as np
import pytest

from realm_jax import cli
from realm_jax.interop import tf_checkpoint as tc
from realm_jax.interop import tfrecord
from realm_jax.tokenization import encode_query
from tests.conftest import REPO, run_cli

FIX = os.path.join(REPO, "tests", "fixtures", "release")
SMOKE = os.path.join(REPO, "configs", "orqa.py") + ":smoke"
VOCAB = 30522
HEADS = 2
QUERY = "module/module/module/"  # ORQA's retriever module: BERT one `module/` deeper
with open(os.path.join(FIX, "blocks.json"), encoding="utf-8") as _f:
    WRITTEN = json.load(_f)  # the blocks and titles the fixture script wrote
QUESTIONS = [
    ("who received the nobel prize in physics in 1921", ["Albert Einstein"]),
    ("what is the capital of japan", ["Tokyo"]),
    ("who discovered polonium and radium", ["Marie Curie", "Pierre Curie"]),
    ("what does a cafe serve", ["coffee"]),
]


def _arch(vocab: int | None = VOCAB, span_width: int = 10) -> list[str]:
    """Overrides: the fixtures' architecture (both BERTs: hidden 16, 2 layers, 24 positions),
    and inputs short enough for 24 positions."""
    out = [
        "model.proj_size=12",
        "model.span_hidden_size=6",
        f"model.max_span_width={span_width}",
        "data.block_len=16",
        "data.query_len=8",
        "qa.reader_len=0",
        "qa.reader_beam_size=3",
        "train.eval_batch_size=8",
    ]
    out += [f"model.vocab_size={vocab}"] if vocab else []
    for part in ("embedder", "reader"):
        for k, v in dict(
            hidden_size=16,
            num_layers=2,
            num_heads=HEADS,
            intermediate_size=36,
            max_position_embeddings=24,
            hidden_act="gelu_new",
        ).items():
            out.append(f"model.{part}.{k}={v}")
    return [f"--config.{o}" for o in out]


def _cli(capsys, argv: list[str]) -> tuple[int, list[str], str]:
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out


# ------------------------------------------------------------------ the release, as a user has it
def _widened(values: dict) -> dict:
    """The fixture's variables with BERT's vocabulary: rows past the fixture's 100 drawn at
    random (seeded), everything else as TensorFlow wrote it."""
    rng = np.random.default_rng(0)
    out = dict(values)
    for name, v in values.items():
        if name.endswith("embeddings/word_embeddings"):
            extra = rng.normal(0, 0.5, (VOCAB - v.shape[0], v.shape[1])).astype(np.float32)
            out[name] = np.concatenate([v, extra])
        elif name.endswith("cls/predictions/output_bias"):
            extra = rng.normal(0, 0.5, VOCAB - v.shape[0]).astype(np.float32)
            out[name] = np.concatenate([v, extra])
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(root, {the release's gs:// path: its local copy}, the NQ model's TF variables)."""
    root = tmp_path_factory.mktemp("release")
    tf_read = np.load(os.path.join(FIX, "reference", "orqa.npz"))  # TensorFlow's reading
    values = _widened({name: tf_read[name] for name in tf_read.files})
    model = root / "realm-data" / "orqa_nq_model_from_realm"
    tc.write_checkpoint(str(model / "export/best_default/checkpoint/model.ckpt-300"), values)
    shutil.copy(os.path.join(FIX, "orqa", "params.json"), model / "params.json")
    embedder = root / "realm-data" / "cc_news_pretrained" / "embedder"
    shutil.copytree(os.path.join(FIX, "embedder"), embedder)
    wiki = root / "orqa-data" / "enwiki-20181220"
    wiki.mkdir(parents=True)
    for name in ("blocks.tfr", "titles.tfr"):
        shutil.copy(os.path.join(FIX, name), wiki / name)
    questions = root / "NQ-open.dev.jsonl"
    questions.write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS)
    )
    paths = {
        "gs://realm-data/orqa_nq_model_from_realm": str(model),
        "gs://realm-data/cc_news_pretrained/embedder": str(embedder),
        "gs://orqa-data/enwiki-20181220/blocks.tfr": str(wiki / "blocks.tfr"),
        "NQ-open.dev.jsonl": str(questions),
    }
    return root, paths, values


# ------------------------------------------------------------------ docs/release.md's commands
SECTION = "## Reproducing the paper's released models"


def readme_commands() -> list[list[str]]:
    """The realm-jax commands of docs/release.md section's sh block, variables expanded."""
    text = open(os.path.join(REPO, "docs", "release.md"), encoding="utf-8").read()
    section = text[text.index(SECTION) :]
    block = section[section.index("```sh\n") + 6 :]
    block = block[: block.index("```")]
    env, out = {}, []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
        if m := re.fullmatch(r"(\w+)=(.*)", line):
            env[m.group(1)] = " ".join(shlex.split(m.group(2)))
            continue
        words = shlex.split(line)
        assert words[0] == "realm-jax", line
        out.append(words[1:])
    return out


def _rehearsal_argv(words: list[str], paths: dict, workdir: str) -> list[str]:
    """A release.md command for the fixtures: gs:// paths to local copies, the workdir to a temp
    folder, and the base config given the fixtures' architecture and input lengths."""
    out = []
    for w in words:
        for url, local in paths.items():
            w = w.replace(url, local)
        out.append(workdir if w == "runs/orqa-nq-release" else w)
    assert "configs/orqa.py:base" in out, out
    out[out.index("configs/orqa.py:base")] = os.path.join(REPO, "configs", "orqa.py") + ":base"
    return out + _arch()


# ------------------------------------------------------------------ an independent reference
def _ln(x, g, b, eps=1e-12):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def _gelu(x):  # BERT's tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def numpy_query_embedding(values: dict, ids: np.ndarray) -> np.ndarray:
    """ORQA's query embedder from its TF variables, in float64: BERT (post-LN, tanh GELU),
    the tanh pooler over [CLS], the dense projection and its LayerNorm. ids [B, L] -> [B, P]."""

    def g(name):
        return np.asarray(values[QUERY + "module/bert/" + name], np.float64)

    def dense(prefix, x):
        return x @ g(prefix + "/kernel") + g(prefix + "/bias")

    B, L = ids.shape
    hd = g("embeddings/word_embeddings").shape[1] // HEADS
    x = g("embeddings/word_embeddings")[ids] + g("embeddings/position_embeddings")[:L]
    x = x + g("embeddings/token_type_embeddings")[0]
    x = _ln(x, g("embeddings/LayerNorm/gamma"), g("embeddings/LayerNorm/beta"))
    bias = np.where(ids[:, None, None, :] != 0, 0.0, -1e9)
    for i in range(2):
        p = f"encoder/layer_{i}/"

        def heads(t):
            return t.reshape(B, L, HEADS, hd).transpose(0, 2, 1, 3)

        q, k, v = (heads(dense(p + f"attention/self/{n}", x)) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + bias
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B, L, -1)
        x = _ln(
            x + dense(p + "attention/output/dense", ctx),
            g(p + "attention/output/LayerNorm/gamma"),
            g(p + "attention/output/LayerNorm/beta"),
        )
        h = dense(p + "output/dense", _gelu(dense(p + "intermediate/dense", x)))
        x = _ln(x + h, g(p + "output/LayerNorm/gamma"), g(p + "output/LayerNorm/beta"))
    pooled = np.tanh(dense("pooler/dense", x[:, 0]))
    proj = pooled @ values[QUERY + "dense/kernel"] + values[QUERY + "dense/bias"]
    return _ln(proj, values[QUERY + "LayerNorm/gamma"], values[QUERY + "LayerNorm/beta"])


def _reference_block_emb() -> np.ndarray:
    return np.load(os.path.join(FIX, "reference", "block_emb.npz"))["block_emb"]  # TF's read


def _brute_force(values, questions, k: int):
    """(top-k block ids [Q, k], their scores) by numpy, and the gap below each k-th score."""
    ids = np.stack([encode_query(q, 8) for q in questions])
    scores = numpy_query_embedding(values, ids) @ _reference_block_emb().T.astype(np.float64)
    order = np.argsort(-scores, axis=1)
    top = np.take_along_axis(scores, order, axis=1)
    return order[:, :k], top[:, :k], np.diff(-top[:, : k + 1], axis=1).min()


# ------------------------------------------------------------------ the rehearsal
@pytest.fixture(scope="module")
def rehearsed(release, tmp_path_factory):
    """The page's four commands on the fixtures: (workdir, {command: its stdout})."""
    _, paths, _ = release
    work = str(tmp_path_factory.mktemp("run") / "orqa-nq-release")
    commands = readme_commands()
    assert [c[0] for c in commands] == ["prepare", "import", "evaluate", "ask"]
    outputs = {}
    for words in commands:
        argv = _rehearsal_argv(words, paths, work)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main(argv)
        assert rc == 0, (argv, out.getvalue())
        outputs[words[0]] = out.getvalue()
    return work, outputs


def test_readme_commands_name_the_release(release):
    commands = readme_commands()
    flat = [w for c in commands for w in c]
    for url in release[1]:
        assert any(url in w for w in flat), url
    assert any(w == "--block_emb" for w in flat) and "configs/orqa.py:base" in flat


def test_evaluate_retrieves_the_release_blocks(release, rehearsed):
    _, _, values = release
    work, _ = rehearsed
    prefix = os.path.join(work, "eval", "NQ-open.dev.dense")
    records = [json.loads(line) for line in open(prefix + ".predictions.jsonl")]
    metrics = json.load(open(prefix + ".metrics.json"))
    assert [r["question"] for r in records] == [q for q, _ in QUESTIONS]
    assert 0.0 <= metrics["exact_match"] <= 1.0 and metrics["questions"] == len(QUESTIONS)
    want, scores, gap = _brute_force(values, [q for q, _ in QUESTIONS], 3)
    assert gap > 1e-3  # the ranking is not decided by rounding
    for r, ids, s in zip(records, want, scores, strict=True):
        assert [b["id"] for b in r["top_blocks"]] == ids.tolist(), r["question"]
        np.testing.assert_allclose([b["score"] for b in r["top_blocks"]], s, atol=1e-4)
        # the ids are the release's: record i of blocks.tfr and titles.tfr
        assert [b["title"] for b in r["top_blocks"]] == [WRITTEN["titles"][i] for i in ids]
        read = r["block"]
        assert WRITTEN["texts"][read["id"]].startswith(read["text"]) and read["text"]


def test_ask_prints_the_release_block_ids(release, rehearsed):
    _, _, values = release
    _, outputs = rehearsed
    question = readme_commands()[-1][-1]
    out = outputs["ask"]
    assert out.startswith("answer: "), out
    shown = [(int(i), t) for i, t in re.findall(r"^  \[.*\] block (\d+): (.*)$", out, re.M)]
    want, _, _ = _brute_force(values, [question], 3)
    assert [i for i, _ in shown] == want[0].tolist(), out
    assert [t for _, t in shown] == [WRITTEN["titles"][i] for i in want[0]]


def test_import_says_what_it_published(rehearsed):
    _, outputs = rehearsed
    out = outputs["import"]
    assert "imported RealmForOpenQA" in out and "block_emb [20 x 12]" in out, out
    assert "query_embedder, doc_embedder, reader" in out and "row i = block i of" in out


def test_reads_the_written_records():
    """The titles the test compares with are the records of titles.tfr (TensorFlow wrote)."""
    titles = [r.decode() for r in tfrecord.read_records(os.path.join(FIX, "titles.tfr"))]
    assert titles == WRITTEN["titles"]


# ------------------------------------------------------------------ gs:// sources
def _import(capsys, work, *args, vocab=100, span_width=10):
    argv = ["import", "--config", SMOKE, "--workdir", str(work), *args]
    return _cli(capsys, argv + _arch(vocab, span_width))


@pytest.mark.system  # CI: the release's import from local files (this module) and gs:// inputs
# read as local ones (test_gcs_paths.py)
def test_gs_sources_import_as_local_ones(tmp_path_factory, tmp_path, capsys):
    """The fixtures from a fake GCS server (tests/support/fake_gcs.py) give the same workdir as the
    local files, and the networks hold the TF variables (the mapping, checked at two ends)."""
    from realm_jax import fs
    from realm_jax import workdir as paths
    from realm_jax.config import load_config
    from realm_jax.index import store
    from realm_jax.train import warm_start
    from tests.support import fake_gcs

    with fake_gcs.module_server(tmp_path_factory, "realm-data") as _:
        fs.upload_tree(os.path.join(FIX, "orqa"), "gs://realm-data/orqa_nq_model_from_realm")
        fs.upload_tree(os.path.join(FIX, "embedder"), "gs://realm-data/cc_news_pretrained/embedder")
        remote = tmp_path / "remote"
        rc, err, _ = _import(
            capsys,
            remote,
            "--source",
            "gs://realm-data/orqa_nq_model_from_realm",
            "--block_emb",
            "gs://realm-data/cc_news_pretrained/embedder",
        )
        assert rc == 0, err
    local = tmp_path / "local"
    rc, err, _ = _import(
        capsys,
        local,
        "--source",
        os.path.join(FIX, "orqa"),
        "--block_emb",
        os.path.join(FIX, "embedder"),
    )
    assert rc == 0, err
    overrides = [o[len("--config.") :] for o in _arch(100)]
    config = load_config(SMOKE, [*overrides, "model.init_span_head_from_realm=true"])
    got = {w: warm_start.realm_params(str(w), config) for w in (remote, local)}
    assert jax.tree.structure(got[remote]) == jax.tree.structure(got[local])
    jax.tree.map(np.testing.assert_array_equal, got[remote], got[local])
    ref = np.load(os.path.join(FIX, "reference", "orqa.npz"))
    np.testing.assert_array_equal(
        got[remote]["query_embedder"]["projection"]["kernel"], ref[QUERY + "dense/kernel"]
    )
    np.testing.assert_array_equal(
        got[remote]["reader"]["span"]["dense_intermediate"]["kernel"], ref["reader/dense/kernel"]
    )
    for w in (remote, local):
        found = store.latest_valid(paths.index_dir(str(w)))
        np.testing.assert_array_equal(store.load_embeddings(found[1]), _reference_block_emb())


def test_sources_combine_into_realms_networks(tmp_path, capsys):
    """embedder + bert modules: REALM's three networks (the start of ORQA fine-tuning);
    orqa + embedder: ORQA's query embedder and reader, the retriever module embedding blocks.
    Each network holds its source's TF variables (the projection and MLM kernels checked)."""
    from realm_jax.config import load_config
    from realm_jax.train import warm_start

    config = load_config(SMOKE, [o[len("--config.") :] for o in _arch(100)])
    ref = {n: np.load(os.path.join(FIX, "reference", n + ".npz")) for n in ("embedder", "orqa")}
    ref["bert"] = np.load(os.path.join(FIX, "reference", "bert.npz"))
    proj = {"embedder": "module/module/dense/kernel", "orqa": QUERY + "dense/kernel"}
    mlm = {"bert": "cls/", "orqa": "reader/module/cls/"}
    cases = {  # sources: (query embedder, document embedder, reader) from
        ("embedder", "bert"): ("embedder", "embedder", "bert"),
        ("orqa", "embedder"): ("orqa", "embedder", "orqa"),
    }
    for sources, (query, doc, reader) in cases.items():
        work = tmp_path / "-".join(sources)
        rc, err, out = _import(capsys, work, *(f"--source={FIX}/{s}" for s in sources))
        assert rc == 0, err
        assert "freshly initialised" not in out, out
        got = warm_start.realm_params(str(work), config)
        for net, src in (("query_embedder", query), ("doc_embedder", doc)):
            np.testing.assert_array_equal(got[net]["projection"]["kernel"], ref[src][proj[src]])
        np.testing.assert_array_equal(
            got["reader"]["mlm"]["transform"]["kernel"],
            ref[reader][mlm[reader] + "predictions/transform/dense/kernel"],
        )


# ------------------------------------------------------------------ bad input: one line, exit 2
def _copy(tmp_path, rel: str):
    dst = tmp_path / rel.replace("/", "_")
    shutil.copytree(os.path.join(FIX, rel), dst)
    return dst


def _truncate_data(tmp_path):
    folder = _copy(tmp_path, "orqa")
    (shard,) = folder.glob("export/best_default/checkpoint/*.data-*")
    os.truncate(shard, shard.stat().st_size // 2)
    return ["--source", str(folder)]


def _truncate_index(tmp_path):
    folder = _copy(tmp_path, "orqa")
    (index,) = folder.glob("export/best_default/checkpoint/*.index")
    index.write_bytes(index.read_bytes()[:-30])
    return ["--source", str(folder)]


def _vocab_file(tmp_path):
    folder = _copy(tmp_path, "embedder")
    (folder / "assets").mkdir()
    (folder / "assets" / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    return ["--source", str(folder)]


BAD = {  # name: (the import's arguments, model.vocab_size override, the message)
    "truncated data": (_truncate_data, 100, "truncated: "),
    "truncated index": (_truncate_index, 100, "not a TensorFlow checkpoint index"),
    "embedder for open QA": (
        lambda t: ["--source", f"{FIX}/embedder", "--block_emb", f"{FIX}/embedder"],
        100,
        "(RealmEmbedder): no open-QA reader (span head)",
    ),
    "BERT beside an index": (
        lambda t: ["--source", f"{FIX}/bert", "--block_emb", f"{FIX}/embedder"],
        100,
        "(RealmKnowledgeAugEncoder): no query embedder for block_emb's index",
    ),
    "two readers": (
        lambda t: ["--source", f"{FIX}/orqa", "--source", f"{FIX}/bert"],
        100,
        "both hold a reader",
    ),
    "no REALM model": (lambda t: ["--source", f"{FIX}/misc"], 100, "no REALM/ORQA model"),
    "block_emb as the model": (
        lambda t: ["--source", f"{FIX}/embedder/encoded"],
        100,
        "holds only block_emb",
    ),
    "no block_emb there": (
        lambda t: ["--source", f"{FIX}/orqa", "--block_emb", f"{FIX}/bert"],
        100,
        "no variable block_emb",
    ),
    "vocab size": (
        lambda t: ["--source", f"{FIX}/orqa"],
        None,
        "vocab_size: config 30522 vs checkpoint 100",
    ),
    "vocab file": (_vocab_file, 100, "vocab.txt differs from realm-jax's vocabulary"),
    "no such source": (
        lambda t: ["--source", str(t / "nowhere")],
        100,
        "nowhere: no such file or folder",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_release_input_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    make, vocab, message = BAD[case]
    work = tmp_path / "work"
    rc, err, _ = _import(capsys, work, *make(tmp_path), vocab=vocab)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("realm-jax import: error: ") and message in err[0], err[0]
    assert not work.exists()


def test_span_width_must_match_the_run(tmp_path, capsys):
    work = tmp_path / "work"
    rc, err, _ = _import(capsys, work, "--source", f"{FIX}/orqa", span_width=5)
    assert rc == 2 and "spans of up to 10 wordpieces" in err[0] and "set it to 10" in err[0]
    assert not work.exists()


def _prepare(capsys, work, corpus) -> None:
    argv = ["prepare", "--config", SMOKE, "--workdir", str(work), f"--config.data.corpus={corpus}"]
    rc, err, _ = _cli(capsys, argv + ["--config.data.masking=random", *_arch(100)])
    assert rc == 0, err


def test_block_emb_must_index_the_prepared_blocks(tmp_path, capsys):
    """A prepared corpus of 19 release blocks, or of a JSONL corpus: block_emb's 20 rows would
    name other blocks; the workdir keeps its data and gets nothing else."""
    short = tmp_path / "short"
    short.mkdir()
    tfrecord.write_records(str(short / "blocks.tfr"), WRITTEN["texts"][:19])
    tfrecord.write_records(str(short / "titles.tfr"), WRITTEN["titles"][:19])
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"id": str(i), "title": t, "text": x}) + "\n"
            for i, (t, x) in enumerate(zip(WRITTEN["titles"], WRITTEN["texts"], strict=True))
        )
    )
    cases = [
        (short / "blocks.tfr", "block_emb has 20 rows, the prepared corpus"),
        (jsonl, "not the release's block records"),
    ]
    for corpus, message in cases:
        work = tmp_path / f"work-{corpus.suffix}"
        _prepare(capsys, work, corpus)
        args = ["--source", f"{FIX}/orqa", "--block_emb", f"{FIX}/embedder"]
        rc, err, _ = _import(capsys, work, *args)
        err = [e for e in err if ": error: " in e]  # (and the workdir line: prepare's record)
        assert rc == 2 and len(err) == 1 and message in err[0], err
        assert sorted(os.listdir(work)) == ["data", "run_config.json"]  # prepare's record


def test_one_line_from_the_real_command(tmp_path):
    """As a user sees it (a process of its own, its logging at INFO): one line on stderr."""
    work = tmp_path / "work"
    argv = ["import", "--config", SMOKE, "--workdir", str(work)]
    argv += ["--source", f"{FIX}/bert", "--block_emb", f"{FIX}/embedder", *_arch(100)]
    r = run_cli(*argv, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "realm-jax import: error: " + f"{FIX}/bert (RealmKnowledgeAugEncoder): no query embedder "
        "for block_emb's index to serve: give an embedder or an open-QA model (RealmForOpenQA) "
        "with it"
    ]
    assert r.stdout == "" and not work.exists()
