"""The Python API (docs/python.md): a trained workdir, loaded once, answering from Python.

    import realm_jax
    model = realm_jax.load("runs/squad-qa")            # a workdir, local or gs://
    model.retrieve("who founded the university?", k=5)  # [Hit(block_id, title, text, score)]
    model.answer("who founded the university?")         # Answer(text, score, block, evidence)
    model.embed_queries(["..."]), model.embed_blocks(["..."], titles=["..."])  # numpy arrays

A workdir is one that `ict`, `train`, `local`, `finetune` or `import` wrote: its config is read
back from <workdir>/run_config.json (what the CLI records there when such a command ends
successfully), or given as `config=`. The
retrievers are the CLI's: dense (the workdir's query embedder against its published index, an
exact inner-product search), bm25 (bm25s over the same blocks) and hybrid (the union of both
top lists, rescored dense + qa.hybrid_bm25_weight x BM25, as `evaluate --retriever hybrid`).
`answer` needs a fine-tuned (QA) workdir: it runs the same Predictor as `ask`. Computation runs
on JAX's default backend (an accelerator when one is installed and visible, else the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os

import numpy as np

from realm_jax import fs, validation
from realm_jax import workdir as paths

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"  # {"config": "configs/x.py:variant", "overrides": [...]}
RETRIEVERS = validation.RETRIEVERS  # dense, bm25, hybrid


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved block: its id in the prepared data, title, text and retrieval score."""

    block_id: int
    title: str
    text: str
    score: float


@dataclasses.dataclass(frozen=True)
class Answer:
    """A predicted answer span, the block it was read from, and the blocks the reader read."""

    question: str
    text: str
    score: float
    block: Hit
    evidence: list[Hit]


def record_run_config(workdir: str, spec: str, overrides: list[str]) -> None:
    """Write the config a command ran with into the workdir (the CLI does, for `load`)."""
    from realm_jax.config import split_spec

    path, variant = split_spec(spec)
    spec = os.path.abspath(path) + (f":{variant}" if variant else "")
    fs.makedirs(paths.root(workdir))
    got = {"config": spec, "overrides": list(overrides), "cwd": os.getcwd()}
    text = json.dumps(got, indent=1)
    fs.write_text(fs.join(paths.root(workdir), RUN_CONFIG), text + "\n")


def _run_config(workdir: str):
    path = fs.join(paths.root(workdir), RUN_CONFIG)
    if not fs.isfile(path):
        raise FileNotFoundError(
            f"{path}: no such file: the workdir records no config (written by the CLI's ict, "
            "train, local, finetune and import); pass config='configs/<file>.py:<variant>'"
        )
    got = json.loads(fs.read_text(path))
    return got["config"], list(got.get("overrides", [])), got.get("cwd", "")


def load(
    workdir: str,
    config: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    checkpoint: str | int = "best",
) -> Model:
    """A trained workdir (local or gs://) ready to retrieve, answer and embed. config: a config
    spec ('configs/orqa.py:squad'), else the one the workdir recorded (with its overrides, then
    `overrides`). checkpoint: best (a fine-tuned workdir's kept best dev checkpoint, else the
    newest), latest, or a step number the workdir holds. Loads on any host, whatever mesh the
    workdir was trained on (sharding.inference_mesh)."""
    from realm_jax.config import load_config, validate
    from realm_jax.interop import sentence_embedder

    checkpoint = validation.checkpoint(checkpoint)  # before any file is read
    from realm_jax.runtime import NOISY_LOGGERS

    for name in NOISY_LOGGERS:  # orbax's, TFDS's, JAX's INFO chatter (through absl): their
        # warnings and errors only, unless the caller set a level for one of them
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    if not fs.isdir(workdir):
        raise FileNotFoundError(f"{workdir}: no such workdir")
    if is_export(workdir):
        return _load_export(workdir, config, list(overrides))
    ran_in = ""
    if config is None:
        config, recorded, ran_in = _run_config(workdir)
        overrides = [*recorded, *overrides]
    cfg = load_config(config, list(overrides))
    sentence_embedder.resolve(cfg, overrides)  # model.init_retriever_from's fields
    d = cfg.data.data_dir
    if d and ran_in and not fs.is_remote(d) and not os.path.isabs(d) and not os.path.isdir(d):
        with cfg.unlocked():  # a relative data_dir of a run started elsewhere: from there
            cfg.data.data_dir = os.path.join(ran_in, d)
    validate(cfg)
    from realm_jax.ops import mips

    mips.set_default_chunk(int(cfg.mesh.get("mips_chunk", mips.DEFAULT_CHUNK)))
    return Model(cfg, workdir, checkpoint)


EXPORT_PARTS = ("openqa", "embedder", "scorer", "reader", "encoder", "doc_embedder")


def is_export(path: str) -> bool:
    """Whether `path` is an `export`ed folder (HF REALM folders), not a workdir."""
    return not fs.isdir(fs.join(path, "checkpoints")) and any(
        fs.isfile(fs.join(path, part, "config.json")) for part in EXPORT_PARTS
    )


def _load_export(path: str, config: str | None, overrides: list[str]) -> Model:
    """An exported folder, imported (`realm-jax import`) into a temporary workdir: its
    networks as checkpoint 0, openqa/'s block_emb as the index. The config it was exported
    with must be given, and its data.data_dir must hold the corpus prepared as the index's
    blocks (row i = block i), as for `import`."""
    import argparse
    import tempfile

    from realm_jax.config import load_config, validate
    from realm_jax.interop import commands as interop
    from realm_jax.interop import sentence_embedder

    if config is None:
        raise ValueError(
            f"{path} is an exported folder, which records no config: pass config= (the one it "
            "was exported with) and overrides=['data.data_dir=<the prepared corpus>']"
        )
    cfg = load_config(config, overrides)
    sentence_embedder.resolve(cfg, overrides)
    validate(cfg)
    if fs.isfile(fs.join(path, "openqa", "config.json")):
        sources = [fs.join(path, "openqa")]
    else:
        sources = [fs.join(path, p) for p in ("embedder", "reader") if fs.isdir(fs.join(path, p))]
    work = tempfile.mkdtemp(prefix="realm-jax-export-")
    if not cfg.data.data_dir:
        raise ValueError("give overrides=['data.data_dir=...']: the corpus of the index's blocks")
    args = argparse.Namespace(workdir=work, source=sources, block_emb="")
    interop.import_command(cfg, args)
    log.info("%s: imported into %s", path, work)
    return Model(cfg, work, "latest")


class Model:
    """A loaded workdir (realm_jax.load). Lists in, lists (or arrays) out; a single string in
    gives a single result."""

    def __init__(self, config, workdir: str, which: str | int = "best"):
        import jax

        from realm_jax import sharding
        from realm_jax.data import datasets

        which = validation.checkpoint(which)
        self.config, self.workdir, self._which = config, workdir, which
        self.is_qa = config.task == "qa"
        self.data_dir = paths.data_dir(config, workdir)
        datasets.check_vocab(config, self.data_dir)  # prepared, and the ids fit the model
        if isinstance(which, int):  # a step the workdir does not hold: an error now
            self._manager()
        # one device of this host, whatever mesh the workdir was trained on
        self._mesh = sharding.inference_mesh(config.mesh, devices=jax.local_devices()[:1])
        self._pin()
        self._params: dict | None = None

    def _pin(self) -> None:
        """Read one corpus version (data/versions.py) for everything: its blocks, its index,
        BM25 over its live blocks; positions map to stable block ids (Hit.block_id)."""
        from realm_jax.data import versions

        self._blocks = versions.open_view(self.config, self.workdir)
        self._predictors: dict[str, tuple] = {}
        self._emb: np.ndarray | None = None
        self._bm25 = None

    @property
    def corpus_version(self) -> int:
        """The corpus version this Model reads (0: the prepared corpus, never updated)."""
        return self._blocks.version

    def update(self, add=None, delete=None, scann_rebuild_share: float | None = None) -> dict:
        """Change the workdir's corpus, not the model (`realm-jax update`): add=[{"id",
        "title", "text"}] adds documents or replaces those ids, delete=["id", ...] deletes;
        only the changed documents' blocks are embedded, with the document embedder that made
        the index, and a new corpus version is published atomically. This Model then reads
        it. Returns the counts and seconds (update.Result)."""
        import dataclasses

        from realm_jax.index import update as update_lib
        from realm_jax.qa.commands import initial_params

        changes = update_lib.api_changes(add, delete)
        share = (
            update_lib.SCANN_REBUILD_SHARE if scann_rebuild_share is None else scann_rebuild_share
        )
        r = update_lib.apply(
            self.config,
            self.workdir,
            changes,
            initial=initial_params,
            source="realm_jax.Model.update",
            scann_rebuild_share=share,
            say=log.info,
        )
        self._pin()
        return dataclasses.asdict(r)

    def __repr__(self) -> str:
        kind = "fine-tuned (QA)" if self.is_qa else f"pre-trained ({self.config.task})"
        return f"realm_jax.Model({self.workdir!r}, {kind}, variant {self.config.variant})"

    # ------------------------------------------------------------------ weights and index
    def _network(self, name: str) -> dict:
        """Host params of one network (query_embedder, doc_embedder) from the workdir's
        checkpoint, restored on first use."""
        if self._params is None:
            self._params = {}
        if name not in self._params:
            from realm_jax import checkpoint, sharding
            from realm_jax.index.embedding import abstract_params

            mgr, step = self._manager()
            self._model, target = abstract_params(self.config, self._mesh, name)
            try:
                got = checkpoint.restore_params_subtree(mgr, step, name, target)
            except (KeyError, ValueError, FileNotFoundError) as e:
                raise ValueError(
                    f"{self.workdir}: checkpoint {step} holds no {name} ({type(e).__name__}: "
                    f"{str(e)[:200]})"
                ) from None
            self._params[name] = sharding.to_host(got)
            log.info("%s: %s from checkpoint %d", self.workdir, name, step)
        return self._params[name]

    def _manager(self):
        from realm_jax import checkpoint

        mgr, step, _ = checkpoint.find_checkpoint(self.config, self.workdir, self._which)
        return mgr, step

    def _index(self) -> np.ndarray:
        if self._emb is None:
            from realm_jax.index import store

            found = store.latest_valid(self._blocks.index_dir)
            if found is None:
                raise FileNotFoundError(
                    f"no valid index in {self._blocks.index_dir}: publish one "
                    "(`realm-jax refresh --max_versions 1`, or `finetune`, which publishes its "
                    "frozen index)"
                )
            emb = np.asarray(store.load_embeddings(found[1]), np.float32)
            if len(emb) != len(self._blocks):
                raise ValueError(
                    f"{found[1]}: {len(emb)} rows for the {len(self._blocks)} blocks of "
                    f"{self._blocks!r}"
                )
            self._emb = emb
        return self._emb

    def _text(self, i: int) -> tuple[str, str]:
        """(title, text) of position i of the pinned version."""
        rec = self._blocks[int(i)]
        return rec["title"].decode(), rec["text"].decode()

    def _hit(self, i: int, score: float) -> Hit:
        """Position i as a Hit naming its stable block id."""
        return Hit(self._blocks.row(i), *self._text(i), float(score))

    def _hit_of_row(self, row: int, score: float) -> Hit:
        return Hit(int(row), *self._blocks.text(row), float(score))

    # -------------------------------------------------------------------------- embedding
    @functools.cached_property
    def _embed_q(self):
        import jax

        from realm_jax.index.embedding import embed_query_tokens

        self._network("query_embedder")
        return jax.jit(functools.partial(embed_query_tokens, self._model))

    @functools.cached_property
    def _embed_b(self):
        import jax

        from realm_jax.index.embedding import embed_block_tokens

        self._network("query_embedder")
        return jax.jit(functools.partial(embed_block_tokens, self._model))

    def embed_queries(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """[len(texts), proj_size] float32: the query embedder's vectors (what retrieval
        scores against the index by inner product; times model.retrieval_scale, which a
        sentence embedder's start sets, e.g. 20 for all-MiniLM-L6-v2: divide by it for the
        model's own unit vectors)."""
        from realm_jax.tokenization import encode_query

        texts = validation.texts(texts, "text")
        batch_size = validation.top_k(batch_size, "batch_size")
        net = {"query_embedder": self._network("query_embedder")}
        n = self.config.data.query_len
        out = []
        for i in range(0, len(texts), batch_size):
            ids = np.stack([encode_query(t, n) for t in texts[i : i + batch_size]])
            out.append(np.asarray(self._embed_q(net, ids), np.float32))
        return np.concatenate(out) if out else np.zeros((0, self._dim()), np.float32)

    def embed_blocks(
        self, texts: list[str], titles: list[str] | None = None, batch_size: int = 64
    ) -> np.ndarray:
        """[len(texts), proj_size] float32: the document embedder's vectors of blocks
        "[CLS] title [SEP] text [SEP]" (cut to data.block_len wordpieces), as the index holds."""
        from realm_jax.model.bert import ModelConfig
        from realm_jax.model.realm import doc_embedder_name
        from realm_jax.tokenization import encode_block

        texts = validation.texts(texts, "text")
        batch_size = validation.top_k(batch_size, "batch_size")
        if titles is None:
            titles = [""] * len(texts)
        else:  # titles may be empty strings, not other types
            titles = [titles] if isinstance(titles, str) else list(titles)
            for i, t in enumerate(titles):
                if not isinstance(t, str):
                    raise validation.InputTypeError(
                        f"titles[{i}] must be a str, got {type(t).__name__} {t!r:.60}"
                    )
        if len(titles) != len(texts):
            raise validation.InputError(f"{len(titles)} titles for {len(texts)} texts")
        name = doc_embedder_name(ModelConfig.from_config(self.config.model, "embedder"))
        net = {name: self._network(name)}
        n = self.config.data.block_len
        out = []
        for i in range(0, len(texts), batch_size):
            pairs = zip(titles[i : i + batch_size], texts[i : i + batch_size], strict=True)
            ids = np.stack([encode_block(t, x, n)[0] for t, x in pairs])
            out.append(np.asarray(self._embed_b(net, ids), np.float32))
        return np.concatenate(out) if out else np.zeros((0, self._dim()), np.float32)

    def _dim(self) -> int:
        return int(self.config.model.proj_size)

    # -------------------------------------------------------------------------- retrieval
    def bm25(self):
        """The BM25 retriever (bm25s) over every block's "title\\ntext", built on first use."""
        if self._bm25 is None:
            from realm_jax.index.bm25 import BM25Retriever

            n = len(self._blocks)
            recs = self._blocks.__getitems__(range(n))
            self._bm25 = BM25Retriever(
                [f"{r['title'].decode()}\n{r['text'].decode()}" for r in recs]
            )
        return self._bm25

    def _retriever(self, retriever):
        """The one given, else the workdir config's qa.retriever (configs/orqa.py:own: hybrid),
        else dense; checked."""
        if retriever is None:
            qa = self.config.get("qa", None)
            retriever = qa.get("retriever", "dense") if qa is not None else "dense"
        return validation.retriever(retriever)

    def retrieve(self, questions, k: int = 5, retriever: str | None = None):
        """The top k blocks of each question (or masked sentence): [Hit] for a string,
        [[Hit]] for a list. retriever: dense, bm25 or hybrid (module docstring); None: the
        config's qa.retriever (dense where it has none)."""
        qs, single = validation.questions(questions)
        k = validation.top_k(k, "k")
        retriever = self._retriever(retriever)
        ids, scores = self._search(qs, k, retriever)
        out = [[self._hit(i, s) for i, s in zip(r, t, strict=True)] for r, t in zip(ids, scores)]
        return out[0] if single else out

    def _search(self, qs: list[str], k: int, retriever: str) -> tuple[np.ndarray, np.ndarray]:
        n = len(self._blocks)
        k = min(k, n)
        if retriever == "bm25":
            return self.bm25().search(qs, k)
        dense = self.embed_queries(qs) @ self._index().T  # [Q, N] exact inner products
        if retriever == "dense":
            top = np.argsort(-dense, axis=1, kind="stable")[:, :k]
            return top, np.take_along_axis(dense, top, 1)
        pool = min(max(int(self.config.get("qa", {}).get("hybrid_pool", 100)), k), n)
        weight = float(self.config.get("qa", {}).get("hybrid_bm25_weight", 1.0))
        lexical, _ = self.bm25().search(qs, pool)
        d_top = np.argsort(-dense, axis=1, kind="stable")[:, :pool]
        ids, scores = [], []
        for b in range(len(qs)):
            union = np.array(list(dict.fromkeys([*d_top[b].tolist(), *lexical[b].tolist()])))
            s = dense[b, union] + weight * self.bm25().scores([qs[b]], union[None])[0]
            order = np.argsort(-s, kind="stable")[:k]
            ids.append(union[order])
            scores.append(s[order])
        return np.stack(ids), np.stack(scores)

    # ----------------------------------------------------------------------------- answers
    def answer(self, questions, retriever: str | None = None, batch_size: int = 8):
        """The reader's answer to each question, with the blocks it read (qa.reader_beam_size
        of them, or qa.eval_reader_beam_size when set): an Answer for a string, [Answer] for a
        list. Fine-tuned workdirs only. retriever: as retrieve's (None: the config's
        qa.retriever)."""
        if not self.is_qa:
            raise ValueError(
                f"{self.workdir} is a pre-training workdir ({self.config.task}): its reader "
                "fills masks, it does not answer; fine-tune it (`realm-jax finetune`) and load "
                "that workdir, or use retrieve()"
            )
        qs, single = validation.questions(questions)
        retriever = self._retriever(retriever)
        batch_size = validation.top_k(batch_size, "batch_size")
        from realm_jax.qa.answers import QAExample
        from realm_jax.qa.commands import open_predictor

        if retriever not in self._predictors:
            self._predictors[retriever] = open_predictor(
                self.config, self.workdir, retriever, self._which, view=self._blocks
            )
        predictor, params, _ = self._predictors[retriever]
        records, _ = predictor.run(params, [QAExample(q, ()) for q in qs], batch_size)
        out = []
        for q, r in zip(qs, records, strict=True):
            # each block's retrieval score: bm25 / hybrid their own, dense the relevance
            evidence = [
                self._hit_of_row(b["id"], b.get(retriever, b["score"])) for b in r["top_blocks"]
            ]  # the records name stable block ids (the predictor maps its positions)
            block = next((h for h in evidence if h.block_id == r["block"]["id"]), evidence[0])
            out.append(Answer(q, r["prediction"], float(r["score"]), block, evidence))
        return out[0] if single else out


def ask_command(config, args) -> int:
    """`realm-jax ask "question"` on a pre-training (REALM or ICT) workdir: the top blocks, with
    their scores (it has no reader fine-tuned to answer: QA configs answer, qa/commands.py).
    dense: index/ask.py (the published index's searcher); --retriever bm25 or hybrid: this
    API's retrievers (Model.retrieve) over the same blocks. An entry point (the CLI's), here
    so that index/ stays below the API."""
    import jax

    from realm_jax.index.ask import ask, one_line

    if not args.question:
        raise ValueError("give a question (interactive mode needs a QA config)")
    question = validation.question(" ".join(args.question))
    top_k = validation.top_k(args.top_k, "--top_k")
    retriever = validation.retriever(getattr(args, "retriever", None) or "dense")
    if retriever == "dense":
        hits = ask(config, args.workdir, question, top_k)
    else:
        found = Model(config, args.workdir, "latest").retrieve(question, top_k, retriever)
        hits = [(h.title, h.text, h.score) for h in found]
    if jax.process_index() == 0:  # several processes: each computes the same, one prints
        for title, text, score in hits:
            print(f"[{score:8.3f}] {one_line(title, 80)}: {one_line(text)}")
    return 0


def update_command(config, args) -> int:
    """`realm-jax update --workdir W --corpus CHANGES [--replace_all]` (index/update.py): an
    entry point, here so that the update (index/) stays below the tasks whose warm start it may
    embed with (a fine-tuning run's frozen index: qa.commands.initial_params)."""
    from realm_jax import fs
    from realm_jax.corpus_errors import CorpusError
    from realm_jax.data import versions
    from realm_jax.index import update as update_lib
    from realm_jax.qa.commands import initial_params

    if not args.corpus:
        raise CorpusError("give --corpus CHANGES.jsonl (or a whole corpus with --replace_all)")
    if not 0.0 <= args.scann_rebuild_share <= 1.0:
        raise CorpusError(
            f"--scann_rebuild_share must be in [0, 1], got {args.scann_rebuild_share}"
        )
    fs.check_buckets([args.corpus])
    if args.replace_all:
        view = versions.open_view(config, args.workdir)
        changes, by_line = update_lib.whole_corpus(args.corpus, view.docs().keys())
    else:
        changes, by_line = update_lib.read_changes(args.corpus), False
    update_lib.apply(
        config,
        args.workdir,
        changes,
        initial=initial_params,
        source=fs.abspath(args.corpus),
        by_line=by_line,
        scann_rebuild_share=args.scann_rebuild_share,
    )
    return 0
