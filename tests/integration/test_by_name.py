"""Models and data by name (issue 47): a HuggingFace hub id wherever a model folder is asked
for, read through huggingface_hub's own code with the hub offline from a hub-layout cache; SQuAD's
own JSON as a corpus and as questions; https:// inputs downloaded once from a loopback server."""

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict

import numpy as np
import pytest

from realm_jax import config as config_lib
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import datasets, download, prepare, squad_json
from realm_jax.interop import hf_import, hub
from realm_jax.qa.answers import QAFormatError, read_questions
from tests.conftest import REPO
from tests.support.runs import QA_TITLES, qa_config

# ------------------------------------------------------------------------------ models by name


def test_what_counts_as_a_hub_id(tmp_path):
    assert hub.looks_like_id("google/bert_uncased_L-2_H-128_A-2")
    assert hub.looks_like_id("bert-base-uncased")
    (tmp_path / "folder").mkdir()
    assert not hub.looks_like_id(str(tmp_path / "folder"))  # an existing folder wins
    for path in ("gs://bucket/model", "https://x/y", "../shared/x", "a/b/c", "", "./m", "/abs/m"):
        assert not hub.looks_like_id(path), path
    assert hub.resolve("gs://bucket/model") == "gs://bucket/model"


def test_an_id_reads_the_same_weights_as_its_folder_offline(shared):
    folder = shared("models", "bert-tiny-mlm")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: the hub offline, a seeded cache
    by_id, fields_id = hf_import.embedder_params(config_lib.BERT_TINY)
    by_dir, fields_dir = hf_import.embedder_params(folder)
    assert fields_id == fields_dir
    flat_id = dict(_flat(by_id))
    flat_dir = dict(_flat(by_dir))
    assert flat_id.keys() == flat_dir.keys() and len(flat_id) > 10
    for k, v in flat_dir.items():
        np.testing.assert_array_equal(flat_id[k], v, err_msg=k)
    snap = hub.resolve(config_lib.BERT_TINY)
    assert snap.startswith(os.environ["HF_HUB_CACHE"]) and "snapshots" in snap


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", np.asarray(v)


def test_an_unknown_id_offline_is_one_line_naming_the_folder_alternative():
    with pytest.raises(hf_import.WeightImportError) as e:
        hf_import.check_folder("nobody-here/no-such-model")
    msg = str(e.value)
    assert "\n" not in msg
    assert "nobody-here/no-such-model: no such folder" in msg
    assert "HF_HUB_OFFLINE" in msg and "hf download nobody-here/no-such-model" in msg


def test_the_cli_imports_a_model_by_id(shared, tmp_path):
    """`realm-jax import --source <hub id>` in a child process (it inherits the offline hub and
    the seeded cache), as a user runs it."""
    shared("models", "bert-tiny-mlm")
    out = subprocess.run(
        [sys.executable, "-m", "realm_jax", "import", "--config", "configs/realm.py:squad",
         "--workdir", str(tmp_path / "w"), "--source", config_lib.BERT_TINY],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.listdir(tmp_path / "w" / "checkpoints")
    bad = subprocess.run(
        [sys.executable, "-m", "realm_jax", "import", "--config", "configs/realm.py:squad",
         "--workdir", str(tmp_path / "w2"), "--source", "nobody-here/no-such-model"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "nobody-here/no-such-model: no such folder" in bad.stderr
    assert "Traceback" not in bad.stderr


# --------------------------------------------------------------------------------- SQuAD JSON

MINI = {
    "version": "v2.0",
    "data": [
        {
            "title": "Ada_Lovelace",
            "paragraphs": [
                {
                    "context": "Ada Lovelace wrote the first program.",
                    "qas": [
                        {"id": "q1", "question": "Who wrote the first program?",
                         "answers": [{"text": "Ada Lovelace", "answer_start": 0},
                                     {"text": "Ada Lovelace", "answer_start": 0},
                                     {"text": "Lovelace", "answer_start": 4}]},
                        {"id": "q2", "question": "Who wrote the last one?", "answers": [],
                         "is_impossible": True},
                    ],
                },
                {"context": "She was born in London.", "qas": [
                    {"id": "q3", "question": "Where was she born?",
                     "answers": [{"text": "London", "answer_start": 16}]}]},
            ],
        }
    ],
}  # fmt: skip


def test_squad_json_as_corpus_and_questions(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(MINI))
    docs = list(corpus_lib.read_documents(str(path)))
    assert docs == [
        ("Ada_Lovelace/0", "Ada Lovelace", "Ada Lovelace wrote the first program."),
        ("Ada_Lovelace/1", "Ada Lovelace", "She was born in London."),
    ]
    qs = read_questions(str(path))  # auto: SQuAD JSON, not WebQuestions
    assert [(q.question, q.answers, q.title, q.qid, q.gold_passage) for q in qs] == [
        ("Who wrote the first program?", ("Ada Lovelace", "Lovelace"), "Ada Lovelace", "q1",
         "Ada_Lovelace/0"),
        ("Where was she born?", ("London",), "Ada Lovelace", "q3", "Ada_Lovelace/1"),
    ]  # fmt: skip
    # a WebQuestions list is still WebQuestions
    wq = tmp_path / "wq.json"
    wq.write_text(json.dumps([{"qId": "a", "qText": "what?", "answers": ["x"]}]))
    assert read_questions(str(wq))[0].qid == "a"
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [{"title": "T"}]}')
    with pytest.raises(corpus_lib.CorpusError, match=r"broken.json: data\[0\]"):
        list(corpus_lib.read_documents(str(broken)))
    with pytest.raises(QAFormatError, match=r"broken.json: data\[0\]"):
        read_questions(str(broken))


# ---------------------------------------------------------------------------- https downloads


class _Server:
    """A loopback HTTP server over a folder, counting GETs by path; `short` paths promise more
    bytes than they send (a dropped connection)."""

    def __init__(self, root):
        self.hits, self.short = defaultdict(int), set()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                server.hits[self.path] += 1
                if self.path in server.short:
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"x" * 10)
                    return
                super().do_GET()

            def log_message(self, *a):
                pass

        handler = functools.partial(Handler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "www"
    root.mkdir()
    s = _Server(root)
    s.root = root
    yield s
    s.close()


def test_a_url_is_downloaded_once_and_failures_leave_nothing(server):
    (server.root / "a.jsonl").write_text('{"title": "t", "text": "x"}\n')
    got = download.local(f"{server.url}/a.jsonl")
    assert open(got).read() == '{"title": "t", "text": "x"}\n' and got.endswith("a.jsonl")
    assert download.local(f"{server.url}/a.jsonl") == got
    assert server.hits["/a.jsonl"] == 1  # the second read is the cached copy
    with pytest.raises(download.DownloadError, match="HTTP 404"):
        download.local(f"{server.url}/missing.json")
    server.short.add("/cut.json")
    with pytest.raises(download.DownloadError, match="stopped after 10 of 1000 bytes"):
        download.local(f"{server.url}/cut.json")
    folder = os.path.dirname(download.cached_path(f"{server.url}/cut.json"))
    assert not os.path.exists(folder) or not os.listdir(folder)  # no partial file kept
    with pytest.raises(download.DownloadError, match="cannot be downloaded"):
        download.local("http://127.0.0.1:9/unreachable.json")


def _sample_as_squad_json(root) -> tuple[str, str]:
    """The bundled sample's two QA articles as SQuAD JSON (paragraphs in corpus order, each with
    the questions whose gold passage it is) and as the JSONL pair they came from."""
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        docs = [json.loads(x) for x in f if json.loads(x)["title"] in QA_TITLES]
    with open(os.path.join(REPO, "data", "sample", "qa.jsonl")) as f:
        qs = [json.loads(x) for x in f if json.loads(x)["title"] in QA_TITLES]
    articles = {}
    for d in docs:
        a = articles.setdefault(
            d["title"], {"title": d["title"].replace(" ", "_"), "paragraphs": []}
        )
        para = {"context": d["text"], "qas": []}
        for i, q in enumerate(qs):
            if q["gold_passage"] == d["id"]:
                para["qas"].append(
                    {"id": f"q{i}", "question": q["question"],
                     "answers": [{"text": t, "answer_start": 0} for t in q["answers"]]}
                )  # fmt: skip
        a["paragraphs"].append(para)
    (root / "train.json").write_text(
        json.dumps({"version": "1.1", "data": list(articles.values())})
    )
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "qa.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    return str(root / "corpus.jsonl"), str(root / "qa.jsonl")


def test_prepare_and_questions_from_squad_json_by_url(server, tmp_path):
    """prepare reads SQuAD's JSON from an https-style URL into the same blocks as the JSONL it
    was made from; the questions read from the same URL carry the corpus's passage ids."""
    _sample_as_squad_json(server.root)
    url = f"{server.url}/train.json"
    a, b = str(tmp_path / "from-jsonl"), str(tmp_path / "from-url")
    prepare.prepare(qa_config(server.root, a), a)
    cfg = qa_config(server.root, b, f"data.corpus={url}", f"qa.train_file={url}")
    summary = prepare.prepare(cfg, b)
    assert summary["corpus"] == url  # as given, not the cached copy
    tok_a, ids_a, titles_a = datasets.load_blocks(a)
    tok_b, ids_b, titles_b = datasets.load_blocks(b)
    np.testing.assert_array_equal(tok_a, tok_b)
    assert titles_a == titles_b
    jsonl = read_questions(str(server.root / "qa.jsonl"))
    by_url = read_questions(url)
    assert [(q.question, q.answers, q.title) for q in by_url] == [
        (q.question, q.answers, q.title)
        for q in sorted(jsonl, key=lambda q: ids_a.index(q.gold_passage))
        if q.gold_passage in ids_a
    ]
    # every question's gold passage is a prepared document of the URL's corpus
    assert {q.gold_passage for q in by_url} <= set(ids_b)
    assert server.hits["/train.json"] == 1  # prepare and the questions share one download
    again = prepare.prepare(cfg, b)  # the same input: reused, not rebuilt
    assert again["fingerprint"] == summary["fingerprint"]


def test_squad_looks_like_reads_only_the_head(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"title": "T", "text": "x"}\n')  # a JSON-lines corpus named .json
    assert not squad_json.looks_like(str(p))
    assert list(corpus_lib.read_documents(str(p)))[0][1:] == ("T", "x")
