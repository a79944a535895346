"""Open-domain QA as a task of the shared loop: `finetune` (and `train` with configs/orqa.py),
`evaluate` and `ask` for fine-tuned workdirs."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import jax
import optax

from realm_jax import checkpoint, fs, sharding, validation, watchdog
from realm_jax import workdir as paths
from realm_jax.data import datasets, pipeline, versions
from realm_jax.index import store
from realm_jax.index.ask import one_line
from realm_jax.index.embedding import (
    Progress,
    abstract_params,
    embed_blocks_in_parts_fn,
    index_dtype,
)
from realm_jax.index.refresher import build_searcher
from realm_jax.model.realm import realm_model
from realm_jax.qa import data as qa_data
from realm_jax.qa import step as qa_step
from realm_jax.qa.answers import (
    QAExample,
    read_predictions,
    read_questions,
    score_predictions,
)
from realm_jax.qa.evaluation import RETRIEVERS, DevEvaluator, FrozenIndex, Predictor
from realm_jax.train import loop
from realm_jax.train.state import create_sharded
from realm_jax.train.warm_start import params_hook

log = logging.getLogger("realm_jax.qa")

CONSOLE_KEYS = (
    "loss",
    "retriever_loss",
    "reader_loss",
    "exact_match",
    "reader_beam_recall",
    "gold_in_beam_rate",  # qa.gold_in_beam runs only
)
EVAL_CONSOLE_KEYS = ("exact_match", "recall@1", "recall@5", "recall@20")
CHECKPOINTS = ("best", "latest", "initial")  # evaluate --checkpoint


def frozen_index(
    config, workdir: str, mesh, model, params, tokens, view=None, at_most: int | None = None
) -> FrozenIndex:
    """The fine-tuning run's frozen index: its published version if it has one (a resume),
    else every block embedded once with the initial document embedder and published (with a
    ScaNN searcher when refresh.build_scann), so `evaluate` and `ask` read the same index.
    view: the corpus version read (versions.View; its live blocks are `tokens`): an updated
    workdir's index is that version's own, published by `update`. at_most: the newest
    version at or before this step (a refreshing fine-tuning's resume: the index its
    checkpoint trained against)."""
    idir = paths.index_dir(workdir) if view is None else view.index_dir
    dim = config.model.proj_size
    found = store.latest_valid(
        idir, expected_num_blocks=len(tokens), expected_dim=dim, exclude=_after(idir, at_most)
    )
    if found is not None:
        log.info("frozen index: %s", found[1])
        return FrozenIndex.put(mesh, store.load_embeddings(found[1]), tokens, index_dtype(config))
    if view is not None and view.version > 0:
        raise store.CorruptIndexError(
            f"{idir}: no valid index of {view!r} ({len(tokens)} blocks, dim {dim})"
        )
    t0 = time.perf_counter()
    batch, dtype = config.refresh.embed_batch_size, index_dtype(config)
    progress = Progress(log, "the frozen index", len(tokens))  # JAX's calls return at once:
    index, emb = FrozenIndex.embed(mesh, model, params, tokens, batch, dtype, progress)  # waited
    log.info(
        "embedded %d blocks in %.1f s (the frozen index)", len(tokens), time.perf_counter() - t0
    )
    # By row ranges, as the refresh job publishes: each process writes its devices' rows;
    # process 0 reads them back only to build ScaNN (a collective: every process calls it).
    searcher_fn = None
    if config.refresh.build_scann:
        searcher_fn = lambda host: build_searcher(config, host)  # noqa: E731
    parts = sharding.owned_row_shards(emb)
    store.publish_rows(
        idir, 0, parts, len(tokens), dim, searcher_fn=searcher_fn, extra={"frozen": True}
    )
    return index


def _after(index_dir: str, step: int | None) -> frozenset[int]:
    """The index versions published after `step` (none when step is None)."""
    if step is None:
        return frozenset()
    return frozenset(s for s in store.list_versions(index_dir) if s > step)


def refresh_index(
    config, workdir: str, mesh, model, params, index: FrozenIndex, step: int, view=None
) -> None:
    """qa.train_doc_embedder: every block embedded again with the current document embedder
    into `index` (in place: the step and the dev evaluation read index.emb) and published as
    index version `step`, as pre-training's in-process refresh does."""
    t0 = time.perf_counter()
    tokens_n = index.num_blocks
    batch, dtype = config.refresh.embed_batch_size, index_dtype(config)
    progress = Progress(log, f"the index at step {step}", tokens_n)
    emb = embed_blocks_in_parts_fn(model, mesh, batch)(params, index.tokens, progress)
    index.emb = emb.astype(dtype)
    searcher_fn = None
    if config.refresh.build_scann:
        searcher_fn = lambda host: build_searcher(config, host)  # noqa: E731
    idir = paths.index_dir(workdir) if view is None else view.index_dir
    store.publish_rows(
        idir,
        step,
        sharding.owned_row_shards(emb),
        tokens_n,
        config.model.proj_size,
        searcher_fn=searcher_fn,
        extra={"refreshed": True},
    )
    log.info("refreshed the index at step %d in %.1f s", step, time.perf_counter() - t0)


def _train(config, workdir: str, stop_event: threading.Event | None = None) -> list[dict]:
    """ORQA fine-tuning; resumable. Returns the logged metrics."""
    tc = config.train
    mesh, ddir, (tokens, doc_ids, _) = loop.setup(config, workdir)
    view = versions.open_view(config, workdir)  # an updated corpus: its newest version's
    if view.version > 0:  # live blocks (positions), its index; records name stable ids
        tokens, doc_ids, _ = view.blocks()
        log.info("fine-tuning over %r", view)
    qa_step.check_config(config, realm_model(config.model), len(tokens), mesh)
    _, arrays = qa_data.training_questions(config, ddir, blocks=(tokens, doc_ids))
    dev = qa_data.dev_questions(config, ddir) if tc.eval_every > 0 else []
    mgr = checkpoint.manager(workdir, keep=tc.keep_checkpoints)
    hook = None if mgr.all_steps() else params_hook(config, span_head=True)
    model, optimizer, state, shardings = qa_step.create_state(
        config, mesh, jax.random.key(tc.seed), hook
    )
    it = iter(qa_data.train_loader(config, arrays))
    q = config.qa  # the iterator runs over the question file's split: a change is refused
    fingerprint = loop.fingerprint(config, ddir) | {
        "qa.train_file": fs.abspath(q.train_file),
        "qa.train_holdout": q.train_holdout,
        "qa.training_questions": len(arrays["question_ids"]),
        "qa.answer_len": q.answer_len,
        "qa.max_answers": q.max_answers,
        # what the step reads: a resume may not switch the gold block insertion on or off
        "qa.gold_in_beam": bool(q.get("gold_in_beam", False)),
    }
    start, state = loop.init_or_resume(
        mgr,
        state,
        shardings,
        it,
        (pipeline.iterator_save_args, pipeline.iterator_restore_args),
        fingerprint=fingerprint,
    )
    refreshing = bool(config.qa.get("train_doc_embedder", False))
    index = frozen_index(
        config,
        workdir,
        mesh,
        model,
        state.params,
        tokens,
        view,
        at_most=start if refreshing else None,
    )
    step_fn = qa_step.compile_train_step(config, mesh, model, optimizer, shardings, len(tokens))
    evaluate = None
    if dev:
        retriever = config.qa.get("dev_retriever", "dense")  # the dev evaluation's
        predictor = Predictor(config, mesh, model, index, ddir, retriever, view=view)
        dev_eval = DevEvaluator(config, predictor, dev)
        best = checkpoint.best_manager(paths.best_dir(workdir), config.qa.best_metric)

        def evaluate(state, step: int) -> dict[str, float]:
            metrics = dev_eval(state, step)
            checkpoint.save_params(best, step, state.params, metrics)  # every process saves
            metrics["best_step"] = float(best.best_step() or step)
            return metrics

    every = int(config.qa.get("refresh_every", 0)) if refreshing else 0
    before_step = waits = None
    if every:

        def waits(step: int) -> bool:
            return step > start and step % every == 0

        def before_step(step: int, state) -> dict:
            if waits(step):
                refresh_index(config, workdir, mesh, model, state.params, index, step, view)
                return {"index_step": float(step)}
            return {}

    task = loop.Task(
        name="qa",
        step=lambda s, b: step_fn(s, b, index.emb, index.tokens),
        evaluate=evaluate,
        before_step=before_step,
        before_step_waits=waits,
        console_keys=CONSOLE_KEYS,
        eval_console_keys=EVAL_CONSOLE_KEYS,
    )
    return loop.run(
        config, workdir, task, state, it, mgr, start, pipeline.iterator_save_args, stop_event
    )


train = loop.trainer_locked(_train)


def finetune(config, args) -> int:
    """`realm-jax finetune` (or `train` with configs/orqa.py)."""
    if config.task != "qa":
        print(
            f"realm-jax finetune: {args.config} is a {config.task!r} config; use configs/orqa.py",
            file=sys.stderr,
        )
        return 2
    ckpts = paths.checkpoint_dir(args.workdir)
    if not (fs.isdir(ckpts) and any(n.isdigit() for n in fs.listdir(ckpts))):  # a fresh run
        from realm_jax.config import check_reader_start

        check_reader_start(config)  # a sentence embedder's retriever beside a random reader
    train(config, args.workdir)
    return 0


# ----------------------------------------------------------------------------- evaluate, ask


def require_checkpoints(workdir: str) -> None:
    """A FileNotFoundError naming the workdir unless it holds a fine-tuning checkpoint folder
    (best/ or checkpoints/; local or gs://): cheap, so `evaluate` and `ask` fail before
    loading data or compiling anything."""
    if not (fs.isdir(paths.best_dir(workdir)) or fs.isdir(paths.checkpoint_dir(workdir))):
        raise FileNotFoundError(
            f"{workdir}: no checkpoints; run `realm-jax finetune` with this workdir first"
        )


def restore_reader(config, workdir: str, mesh, which="best"):
    """(model, params {query_embedder, reader}, step, where) of a fine-tuned workdir: the best
    dev checkpoint (`which`="best", falling back to the newest when none was kept), the newest
    one ("latest") or a step number it holds (checkpoint.find_checkpoint), restored to `mesh`'s
    shardings whatever mesh it was saved from."""
    if not (fs.isdir(paths.best_dir(workdir)) or fs.isdir(paths.checkpoint_dir(workdir))):
        raise FileNotFoundError(
            f"{workdir}: no checkpoints; run `realm-jax finetune` with this workdir first"
        )
    mgr, step, where = checkpoint.find_checkpoint(config, workdir, which)
    params = {}
    for name in ("query_embedder", "reader"):
        model, target = abstract_params(config, mesh, name)
        params[name] = checkpoint.restore_params_subtree(mgr, step, name, target)
    return model, params, step, where


def warm_start_source(config) -> str:
    """Where the config's fine-tuning starts from, in words (`evaluate --checkpoint initial`)."""
    m = config.model
    fields = [
        f"model.{f}={m[f]}"
        for f in (
            "init_from_realm",
            "init_embedders_from_ict",
            "init_embedder_from",
            "init_reader_from",
        )
        if m.get(f, "")
    ]
    return ", ".join(fields) or f"random initialisation, train.seed={config.train.seed}"


def initial_params(config, mesh):
    """(model, params of every network) of the config's warm start: the weights a fresh
    fine-tuning run starts from (qa/step.py create_state: the model initialised with
    train.seed, then the config's weight imports, params_hook(span_head=True)), built the same
    way but without an optimizer state."""
    model, _, init_params = qa_step.state_parts(config)
    state, _ = create_sharded(
        mesh,
        init_params,
        optax.identity(),
        jax.random.key(config.train.seed),
        params_hook(config, span_head=True),
        fsdp=config.mesh.get("fsdp", False),
    )
    return model, dict(state.params)


def open_predictor(
    config, workdir: str, retriever: str, which: str = "best", model=True, view=None
):
    """(predictor, params, description) for `evaluate` and `ask` over a fine-tuned workdir's
    frozen index. which: best / latest (restore_reader) or "initial": the config's warm start
    (initial_params), the networks fine-tuning starts from, against the index `finetune`
    published from the same initial document embedder, or embedded and published here when
    the workdir has none yet (retrieval alone: the pre-trained retriever's zero-shot recall).
    model=False (BM25 retrieval alone): no checkpoint is read, params are None.
    view: the corpus version to read (versions.View; default the workdir's newest): its live
    blocks, its index."""
    which = validation.checkpoint(which, CHECKPOINTS)  # best, latest, initial or a step
    validation.retriever(retriever, RETRIEVERS)
    mesh = sharding.inference_mesh(config.mesh, batch_size=int(config.train.eval_batch_size))
    ddir = paths.data_dir(config, workdir)
    if model:  # the blocks and questions are embedded: their ids must fit the vocabulary
        datasets.check_vocab(config, ddir)
    view = view if view is not None else versions.open_view(config, workdir)
    tokens, doc_ids, _ = view.blocks()
    found = store.latest_valid(
        view.index_dir,
        expected_num_blocks=len(tokens),
        expected_dim=config.model.proj_size,
    )
    index = None
    if model and which == "initial":
        net, params = initial_params(config, mesh)
        source = f"initial (the warm start: {warm_start_source(config)})"
        if found is None:  # zero-shot before any fine-tuning: the warm start's own index,
            # embedded and published as `finetune` does at its start (which then reuses it)
            index = frozen_index(config, workdir, mesh, net, params, tokens, view)
    elif found is None:
        raise FileNotFoundError(
            f"no valid index in {view.index_dir}: run `realm-jax finetune` with this "
            "workdir first (it publishes the frozen index)"
        )
    elif model:
        net, params, step, where = restore_reader(config, workdir, mesh, which)
        source = f"{where} checkpoint {step} of {workdir}"
        if config.qa.get("train_doc_embedder", False):  # a refreshing run's index versions:
            # the newest at or before the checkpoint, the one its query embedder trained with
            found = (
                store.latest_valid(
                    view.index_dir,
                    expected_num_blocks=len(tokens),
                    expected_dim=config.model.proj_size,
                    exclude=_after(view.index_dir, step),
                )
                or found
            )
            source += f", index version {found[0]}"
    else:
        net, params, source = realm_model(config.model), None, "no model (retrieval alone)"
    if index is None:
        index = FrozenIndex.put(mesh, store.load_embeddings(found[1]), tokens, index_dtype(config))
    gold = (tokens, doc_ids) if retriever == "gold" else None  # the host table: gold only
    predictor = Predictor(config, mesh, net, index, ddir, retriever, blocks=gold, view=view)
    return predictor, params, source


def evaluation_questions(config, args, ddir: str) -> tuple[list[QAExample], str]:
    """The questions `evaluate` scores: --questions FILE (all of it), else the config's dev
    split; --limit keeps the first N."""
    if args.questions:
        examples, name = read_questions(args.questions, args.format), args.questions
    else:
        q = config.qa
        examples = qa_data.load_questions(q.dev_file, q.format, q.dev_holdout, ddir)
        name = f"{q.dev_file} ({q.dev_holdout})"
    if args.limit > 0:
        examples = examples[: args.limit]
    return examples, name


def evaluate(config, args) -> int:
    """`realm-jax evaluate`: exact match and recall@k, a predictions file, a metrics file."""
    if config.task != "qa":
        print(
            f"realm-jax evaluate: {args.config} is not a QA config (configs/orqa.py)",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "retriever", None) is None:  # not given: the config's (cli.py too)
        args.retriever = config.qa.get("retriever", "dense")
    args.checkpoint = validation.checkpoint(args.checkpoint, CHECKPOINTS)  # before any work
    if args.limit < 0:
        raise validation.InputError(f"--limit must be 0 (every question) or more, got {args.limit}")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    bm25, gold = args.retriever == "bm25", args.retriever == "gold"
    alone = args.retrieval_only
    initial = args.checkpoint == "initial" and not (alone and bm25)  # BM25 alone: no model
    if gold and alone and not args.predictions:
        print(
            "realm-jax evaluate: --retriever gold reads each question's gold passage: there is "
            "no retrieval for --retrieval_only to score",
            file=sys.stderr,
        )
        return 2
    fs.check_buckets([args.questions, args.predictions, args.output])  # cli: workdir, config
    ddir = paths.data_dir(config, args.workdir)
    examples, name = evaluation_questions(config, args, ddir)  # a bad file: named first
    if gold and not args.predictions and not any(e.gold_passage for e in examples):
        print(
            f"realm-jax evaluate: --retriever gold needs SQuAD-style questions with a "
            f"'gold_passage' field (a corpus id); {name} has none",
            file=sys.stderr,
        )
        return 2
    if not args.predictions and not (alone and bm25) and not initial:
        require_checkpoints(args.workdir)  # initial: only the published index (open_predictor)
    if args.predictions:  # score a predictions file (ORQA's evaluate_predictions), no model
        m = score_predictions(examples, read_predictions(args.predictions))
        if jax.process_index() == 0:
            print(
                f"{name} against {args.predictions}: {m['missing_predictions']} missing "
                f"predictions; accuracy {m['accuracy']:.4f} ({m['num_correct']}/{m['num_total']})"
            )
        return 0
    predictor, params, source = open_predictor(
        config, args.workdir, args.retriever, args.checkpoint, model=not (alone and bm25)
    )
    # a long evaluation stuck while its JAX client beats exits (75): every batch is a beat
    with watchdog.from_config(config.train, "evaluation batch") as wd:
        records, metrics = predictor.run(
            params, examples, int(config.train.eval_batch_size), read=not alone, on_batch=wd.beat
        )
    metrics.update(
        cpu_seconds=time.process_time() - cpu0,
        wall_seconds=time.perf_counter() - wall0,
    )
    if jax.process_index() != 0:  # several processes computed the same: process 0 writes
        return 0
    out = args.output or output_prefix(args.workdir, name, args.retriever, alone, initial)
    summary = {
        "questions_file": name,
        "retriever": args.retriever,
        "checkpoint": None if source.startswith("no model") else args.checkpoint,
        "model": source,
        **metrics,
    }
    write_evaluation(out, records, summary)
    shown = ", ".join(
        f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith(("exact", "recall", "gold_"))
    )
    print(
        f"{name}: {len(records)} questions, {args.retriever} retriever, {source}: {shown}; "
        f"{metrics['cpu_seconds']:.0f} CPU s, {metrics['wall_seconds']:.0f} s\n"
        f"wrote {out}.predictions.jsonl and {out}.metrics.json"
    )
    return 0


def output_prefix(
    workdir: str, name: str, retriever: str, alone: bool, initial: bool = False
) -> str:
    """`evaluate`'s default output prefix: WORKDIR/eval/<question file stem>.<retriever>
    [-initial: --checkpoint initial][-retrieval: --retrieval_only]."""
    stem = os.path.splitext(fs.basename(name.split(" ")[0]))[0]
    tail = ("-initial" if initial else "") + ("-retrieval" if alone else "")
    return fs.join(paths.eval_dir(workdir), f"{stem}.{retriever}{tail}")


def write_evaluation(out: str, records: list[dict], summary: dict) -> None:
    """<out>.predictions.jsonl and <out>.metrics.json, each written whole (local: a renamed
    temp file; gs://: one upload), so a reader never sees half a file."""
    fs.makedirs(fs.dirname(fs.abspath(out)))
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    fs.write_text(out + ".predictions.jsonl", lines)
    fs.write_text(out + ".metrics.json", json.dumps(summary, indent=2))


def _show(record: dict, top_k: int, retriever: str, text_of) -> str:
    """The answer, then each block read: the score of the retriever that found it (dense
    relevance, BM25's score, hybrid's dense + weight x BM25), its title and its text."""
    block = record["block"]
    lines = [
        f"answer: {record['prediction']!r}  (from {one_line(block['title'], 80)!r}, "
        f"block {block['id']}, score {record['score']:.2f})"
    ]
    for b in record["top_blocks"][:top_k]:
        score = b.get(retriever, b["score"])
        lines.append(f"  [{score:8.3f}] block {b['id']}: {one_line(b['title'], 80)}")
        lines.append(f"             {one_line(text_of(b['id']))}")
    return "\n".join(lines)


def ask(config, args) -> int:
    """`realm-jax ask` with a QA config: the predicted answer span and the blocks it read;
    with no question, an interactive prompt (one question a line, empty line or EOF ends)."""
    validation.top_k(args.top_k, "--top_k")
    if getattr(args, "retriever", None) is None:  # not given: the config's (cli.py too)
        args.retriever = config.qa.get("retriever", "dense")
    validation.retriever(args.retriever)
    question = " ".join(args.question)
    if args.question:
        validation.question(question)
    require_checkpoints(args.workdir)  # before the data is read and the model compiled
    predictor, params, source = open_predictor(config, args.workdir, args.retriever)
    log.info("answering with the %s", source)

    view = predictor.blocks  # the corpus version read (versions.View): records name its rows

    def text_of(block_id: int) -> str:
        return view.text(block_id)[1]

    def answer(question: str) -> None:
        records, _ = predictor.run(params, [QAExample(question, ())], 1)
        if jax.process_index() == 0:  # every process answers (collectives), process 0 prints
            print(_show(records[0], args.top_k, args.retriever, text_of), flush=True)

    if args.question:
        answer(question)
        return 0
    first = jax.process_index() == 0
    interactive = first and sys.stdin.isatty()
    while True:
        if interactive:
            print("question> ", end="", flush=True)
        # process 0 reads the question; every process answers it
        line = sharding.broadcast_text(sys.stdin.readline() if first else "")
        if not line.strip():
            return 0
        answer(line.strip())
