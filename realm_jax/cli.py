"""`python -m realm_jax <command>` (also `realm-jax`): the one entry point.

Every command takes --config configs/realm.py:<variant> and overrides as
--config.section.field=value; the config is locked, so an unknown key is an error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

COMMANDS = {
    "prepare": "build the TFDS block and pre-training datasets from raw text",
    "train": "train config.task: REALM (trainer only; pair it with `refresh`) or ICT",
    "refresh": "the index refresh job: re-embed the corpus from new checkpoints, publish",
    "local": "trainer + refresher together on one machine (Ctrl-C stops both)",
    "ict": "the Inverse Cloze Task warm start of the embedders (configs/ict.py)",
    "finetune": "open-domain QA fine-tuning, ORQA style (configs/orqa.py)",
    "evaluate": "open-domain QA: exact match and recall@k of a fine-tuned workdir",
    "ask": "answer a question (QA workdir) or show its top blocks (pre-training workdir)",
    "sweep": "run a config file's sweep() as an Optuna study: parallel workers, pruning, a table",
    "plan": "compile the config's programs for a TPU slice ahead of time: does it fit?",
    "import": "HF REALM folders or the release's TF checkpoints -> a workdir (+ block_emb index)",
    "export": "a workdir's checkpoint -> HuggingFace REALM folders (safetensors)",
    "world": "generate a seeded knowledge world (corpus, annotated text, QA) into --workdir",
    "update": "add, replace and delete documents of a trained workdir's corpus (no training)",
}

# Training commands: their process's watchdog runs from start-up (the checkpoint restore) to
# shut-down (the final save), not only around the loop (watchdog.for_process; issue 58).
WATCHED = ("train", "local", "ict", "finetune")

# command -> "module:function" (imported only when run). `train` and `local` depend on the
# config's task (config.task): TASK_COMMANDS[task][command].
ENTRY = {
    "prepare": "realm_jax.data.prepare:command",
    "refresh": "realm_jax.index.refresher:command",
    "ict": "realm_jax.ict.commands:command",
    "finetune": "realm_jax.qa.commands:finetune",
    "evaluate": "realm_jax.qa.commands:evaluate",
    "plan": "realm_jax.plan:command",
    "import": "realm_jax.interop.commands:import_command",
    "export": "realm_jax.interop.commands:export_command",
    "world": "realm_jax.data.world:command",
    "update": "realm_jax.api:update_command",
}
# commands that write a workdir's data or networks: its config is recorded there
# (run_record.RUN_CONFIG = api.RUN_CONFIG), and every command on the workdir reads it back
RECORDS_CONFIG = ("prepare", "train", "local", "ict", "finetune", "import")
# commands whose --workdir is not a run's workdir: they read no record
NO_RECORD = ("sweep", "world")
TASK_COMMANDS = {
    "realm": {
        "train": "realm_jax.pretrain.commands:train_command",
        "local": "realm_jax.pretrain.commands:local",
        "ask": "realm_jax.api:ask_command",
    },
    "ict": {
        "train": "realm_jax.ict.commands:command",
        "local": "realm_jax.ict.commands:command",
        "ask": "realm_jax.api:ask_command",
    },
    "qa": {
        "train": "realm_jax.qa.commands:finetune",
        "local": "realm_jax.qa.commands:finetune",
        "ask": "realm_jax.qa.commands:ask",
    },
}


def entry_point(command: str, config) -> str:
    """The "module:function" that runs `command` for this config."""
    if command in ENTRY:
        return ENTRY[command]
    task = config.task
    if task not in TASK_COMMANDS:
        from realm_jax.config import ConfigError

        raise ConfigError(f"task={task!r}: must be one of {', '.join(TASK_COMMANDS)}")
    return TASK_COMMANDS[task][command]


def _parser() -> argparse.ArgumentParser:
    from realm_jax.config import default_config_path

    p = argparse.ArgumentParser(
        prog="realm-jax",
        description="REALM retrieval-augmented pre-training in JAX/Flax.",
        epilog="Config overrides: --config.train.lr=1e-4 (any field of the config file).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.add_argument(
            "--config",
            default=None,
            help="config file and variant, e.g. configs/realm.py:smoke (default: the one "
            f"recorded in the workdir's run_config.json, else {default_config_path()}:smoke)",
        )
        if name == "plan":
            s.add_argument(
                "--workdir",
                default="",
                help="optional: a workdir whose prepared corpus gives the number of blocks",
            )
        elif name == "sweep":
            s.add_argument("--workdir", default="", help="prefix: trial T runs in PREFIX/T")
        else:
            s.add_argument(
                "--workdir", required=True, help="run directory (data, checkpoints, index, tb)"
            )
        s.add_argument(
            "--cpu_devices",
            type=int,
            default=0,
            help="fake this many CPU devices (testing sharding on one machine)",
        )
        s.add_argument("--coordinator", default="", help="multi-process: coordinator host:port")
        s.add_argument("--num_processes", type=int, default=1, help="multi-process: process count")
        s.add_argument("--process_id", type=int, default=0, help="multi-process: this process")
        s.add_argument(
            "--multihost",
            action="store_true",
            help="call jax.distributed.initialize() with auto-detection (TPU pods)",
        )
        s.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="debug logging, and the traceback of an error",
        )
        if name == "prepare":
            s.add_argument(
                "--overwrite",
                action="store_true",
                help="replace a prepared dataset built from different input",
            )
            s.add_argument(
                "--beam_runner",
                default="",
                help="prepare on Apache Beam with this runner (DirectRunner, DataflowRunner); "
                "default: data.engine decides, DirectRunner when it picks Beam",
            )
            s.add_argument(
                "--beam_options",
                default="",
                help="Beam pipeline flags, e.g. --beam_options='--direct_num_workers=2 "
                "--direct_running_mode=multi_processing' (the default) or Dataflow's "
                "--project/--region/--temp_location (tpu/README.md)",
            )
        if name == "plan":
            s.add_argument(
                "--topology",
                required=True,
                help="Cloud TPU slice (v3-64, v4-64, v5e-256, v5p-128, ...), a libtpu "
                "topology (v4:2x2x2), or cpu:N fake CPU devices",
            )
            s.add_argument(
                "--num_blocks",
                type=int,
                default=0,
                help="corpus blocks (default: the workdir's prepared corpus, else REALM's "
                "13,353,718 Wikipedia blocks)",
            )
            s.add_argument(
                "--hbm_gib", type=float, default=0.0, help="HBM per device (default: the chip's)"
            )
            s.add_argument("--json", default="", help="also write the figures to this file")
            s.add_argument(
                "--programs",
                choices=("all", "train", "refresh"),
                default="all",
                help="compile only the train step, or only the refresh job's corpus embedding "
                "(the program a refresh slice runs)",
            )
        if name == "sweep":
            _sweep_arguments(s)
        if name == "update":
            s.add_argument(
                "--corpus",
                default="",
                help="CHANGES.jsonl: {id, title, text} adds or replaces, {id, delete: true} "
                "deletes; with --replace_all a whole new corpus (any format prepare reads)",
            )
            s.add_argument(
                "--replace_all",
                action="store_true",
                help="--corpus is the whole new corpus: diffed by id and content, ids it lacks "
                "are deleted",
            )
            s.add_argument(
                "--scann_rebuild_share",
                type=float,
                default=0.1,
                help="rebuild ScaNN once the rows changed since its build pass this share of "
                "the index (below it: ScaNN's own upsert and delete)",
            )
        if name in ("import", "export"):
            _hf_arguments(s, name)
        if name == "refresh":
            s.add_argument(
                "--max_versions",
                type=int,
                default=None,
                help="exit after publishing this many index versions",
            )
        if name == "ask":
            s.add_argument(
                "question",
                nargs="*",
                help="the question or masked sentence (QA configs: none = interactive)",
            )
            s.add_argument("--top_k", type=int, default=5, help="blocks to show")
        if name == "ask":
            s.add_argument(
                "--retriever",
                choices=("dense", "bm25", "hybrid"),
                default=None,
                help="QA: the fine-tuned retriever over the frozen index, BM25 (bm25s) over "
                "the same blocks, or hybrid (both top lists joined and rescored: dense + "
                "qa.hybrid_bm25_weight x BM25); the same reader reads any. Default: the "
                "config's qa.retriever (dense; configs/orqa.py:own hybrid), else dense",
            )
        if name == "evaluate":
            s.add_argument(
                "--retriever",
                choices=("dense", "bm25", "hybrid", "gold"),
                default=None,
                help="QA: the fine-tuned retriever over the frozen index, BM25 (bm25s) over "
                "the same blocks, hybrid (both top lists joined and rescored: dense + "
                "qa.hybrid_bm25_weight x BM25), or gold: no retrieval, the reader reads each "
                "question's gold "
                "passage (SQuAD-style questions with a gold_passage field; its blocks repeated "
                "to fill the reader beam; questions without one are counted as gold_missing "
                "and scored wrong): the reader's exact match alone. The same reader reads all. "
                "Default: the config's qa.retriever (dense; configs/orqa.py:own hybrid)",
            )
            s.add_argument(
                "--questions",
                default="",
                help="question file (default: the config's qa.dev_file split): NQ-open "
                "JSONL {question, answer}, SQuAD-style JSONL {question, answers[, title]}, "
                "SQuAD JSON (train-v1.1.json), WebQuestions JSON, CuratedTREC TSV (regex "
                "answers); an https:// URL is downloaded once",
            )
            s.add_argument(
                "--format",
                default="auto",
                choices=("auto", "nq", "squad", "squad_json", "webquestions", "curatedtrec"),
                help="question file format (auto: by extension and fields)",
            )
            s.add_argument("--limit", type=int, default=0, help="score the first N (0 = all)")
            s.add_argument(
                "--predictions",
                default="",
                help="score this predictions JSONL ({question, prediction} per line, ORQA's "
                "format) against the questions instead of running a model",
            )
            s.add_argument(
                "--retrieval_only",
                action="store_true",
                help="recall@k of the retriever alone, no reader (BM25: no model needed)",
            )
            s.add_argument(
                "--output",
                default="",
                help="path prefix of <prefix>.predictions.jsonl / .metrics.json "
                "(default <workdir>/eval/<file>.<retriever>)",
            )
            s.add_argument(
                "--checkpoint",
                default="best",
                help="best: the best dev checkpoint (kept by finetune), latest: the newest, a "
                "step number the workdir holds, or initial: the "
                "config's warm start (model.init_*: the query embedder and reader fine-tuning "
                "starts from, no checkpoint needed) against the workdir's frozen index (embedded "
                "and published first when the workdir has none); with --retrieval_only the "
                "pre-trained retriever's zero-shot recall@k",
            )
    return p


def _hf_arguments(s: argparse.ArgumentParser, name: str) -> None:
    if name == "import":
        s.add_argument(
            "--source",
            required=True,
            action="append",
            help="HuggingFace folder (config.json + model.safetensors or pytorch_model.bin): "
            "BertModel, BertForMaskedLM, RealmEmbedder, RealmScorer, RealmKnowledgeAugEncoder, "
            "RealmReader or RealmForOpenQA; or the REALM/ORQA release's TF checkpoint or TF-Hub "
            "module (cc_news_pretrained/embedder or bert, orqa_nq_model_from_realm); local or "
            "gs://; checked against --config. Repeat to combine (embedder + bert)",
        )
        s.add_argument(
            "--block_emb",
            default="",
            help="the release's block embeddings (encoded/encoded.ckpt, or the embedder module "
            "holding encoded/), published AS IS as the index: row i = block i of blocks.tfr "
            "(prepare it with --config.data.corpus=.../blocks.tfr)",
        )
    else:
        s.add_argument("--out", required=True, help="a new local folder for the HF folders")
        s.add_argument(
            "--checkpoint",
            default="latest",
            help="latest, best (fine-tuning's best dev checkpoint) or a step number",
        )


def _sweep_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--workers",
        type=int,
        default=0,
        help="worker processes on this host, each on its own devices (CPU: sharing the cores; "
        "GPUs: an equal share each; a TPU VM: its chips split); default 1, with --tpu one a slice",
    )
    s.add_argument(
        "--trials",
        type=int,
        default=0,
        help="a search's number of finished (complete or pruned) trials, those already in the "
        "study included (default: the config's Search(trials=...)); a grid runs its points",
    )
    s.add_argument(
        "--storage",
        default="",
        metavar="URL",
        help="the study's database: sqlite:///PREFIX/study.db by default; postgresql://..., "
        "mysql://... or grpc://HOST:PORT (python -m realm_jax.sweep.proxy) for workers on "
        "several hosts, a gs:// PREFIX or --tpu",
    )
    s.add_argument(
        "--study",
        default="",
        metavar="NAME",
        help="the study's name in the storage (default sweep)",
    )
    s.add_argument(
        "--tpu",
        default="",
        metavar="NAME:ZONE[,NAME:ZONE...]",
        help="run the trials on these TPU VM slices through tpu/launch.sh, worker i on slice i "
        "(tpu/sweep.sh; PREFIX: gs:// or a shared mount; the data prepared beforehand)",
    )
    s.add_argument(
        "--dry_run",
        action="store_true",
        help="print the prepare and trial commands (with --tpu: the tpu/launch.sh lines), run "
        "nothing",
    )
    s.add_argument(
        "--heartbeat_s",
        type=float,
        default=30.0,
        help="seconds between a worker's heartbeats for its running trial",
    )
    s.add_argument(
        "--grace_s",
        type=float,
        default=120.0,
        help="a running trial without a heartbeat for this long is failed and retried once",
    )
    s.add_argument(
        "--table",
        default="",
        metavar="PREFIX",
        help="only rewrite PREFIX's sweep.md, sweep.csv and plots/ from the study",
    )


# Errors a user causes and can fix (input, config, data, weights, workdir, mesh): every
# command prints them as ONE line, `realm-jax <command>: error: <message>`, and exits
# EXIT_USER_ERROR (-v/--verbose adds the traceback). Named "module:Class" and matched along the
# exception's class hierarchy, so printing an error never imports a module (TFDS, JAX) that the
# command had not loaded; an exception of a class defined in an unloaded module cannot occur.
EXPECTED_ERRORS = (
    "realm_jax.config:ConfigError",  # config file, variant, override or value
    "realm_jax.lock:LockError",  # the workdir is held by another trainer/refresher
    "realm_jax.corpus_errors:CorpusError",  # malformed or missing corpus input (file:line)
    "realm_jax.data.datasets:PrepareError",  # no/partial/old prepared data, nothing usable
    "realm_jax.sharding:MeshError",  # a mesh that does not fit the devices or the batch
    "realm_jax.interop.hf_import:WeightImportError",  # a weights folder that cannot be imported
    "realm_jax.model.bert:ModelConfigError",  # config.model that describes no valid network
    "realm_jax.index.store:CorruptIndexError",  # a published index that fails its checks
    "realm_jax.qa.answers:QAFormatError",  # a QA question file that cannot be read
    "realm_jax.checkpoint:NoRestorableCheckpoint",  # every checkpoint of the workdir damaged
    "realm_jax.plan:PlanError",  # a slice the config does not fit or cannot run on
    "realm_jax.fs:StorageError",  # a gs:// bucket that is missing, forbidden or unreachable
    "gcsfs.retry:HttpError",  # a gs:// request still failing after gcsfs's retries (429, 5xx)
)
# ValueError and FileNotFoundError are expected too when realm_jax's own code raised them (its
# validation: "--top_k must be at least 1", "no checkpoint in ..."); raised inside a library
# they are a bug and keep their traceback.
OWN_VALIDATION_ERRORS = (ValueError, FileNotFoundError)
EXIT_USER_ERROR = 2  # an expected error (argparse's usage errors exit 2 too)
EXIT_FAILURE = 1  # an unexpected exception (traceback) or a stopped run


def _raised_by_realm_jax(error: BaseException) -> bool:
    """Whether the innermost frame of the error's traceback is realm_jax code."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(
        package
    )


def is_expected(error: BaseException) -> bool:
    """An error to report as one line (exit 2) rather than as a traceback (exit 1)."""
    names = {f"{c.__module__}:{c.__qualname__}" for c in type(error).__mro__}
    if names.intersection(EXPECTED_ERRORS):
        return True
    return isinstance(error, OWN_VALIDATION_ERRORS) and _raised_by_realm_jax(error)


def error_line(command: str, error: BaseException) -> str:
    """`realm-jax <command>: error: <message>` on one line."""
    message = " ".join(str(error).split()) or type(error).__name__
    if type(error).__module__.startswith("gcsfs"):  # HTTP status and text: say where it came from
        message = f"gs:// request failed after gcsfs's retries with backoff: {message}"
    return f"realm-jax {command}: error: {message}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    parser = _parser()
    args = parser.parse_args(rest)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return _run(args, [o[len("--config.") :] for o in overrides])
    except Exception as e:
        if not is_expected(e):
            raise  # the traceback, exit 1
        if args.verbose:
            traceback.print_exc()
        print(error_line(args.command, e), file=sys.stderr)
        return EXIT_USER_ERROR


def _resolve_config(args, overrides: list[str]):
    """The config this command runs with: --config and the command line's overrides on top of
    the workdir's record (run_record.resolve), with one line saying what it took and changed
    (commands that record their config: RECORDS_CONFIG).
    Sets args.config (the spec run) and args.overrides (every override, in order)."""
    from realm_jax import run_record
    from realm_jax.config import default_config_path, load_config

    if args.command in NO_RECORD or not getattr(args, "workdir", ""):
        args.config = args.config or f"{default_config_path()}:smoke"
        args.overrides = list(overrides)
        return load_config(args.config, overrides)
    got = run_record.resolve(args.command, args.workdir, args.config, overrides)
    config = load_config(got.spec, got.overrides)
    for note in got.notes:
        print(f"realm-jax {args.command}: {note}", file=sys.stderr)
    if got.from_record and args.command in RECORDS_CONFIG:  # evaluate, ask, refresh and
        # export only read the record and leave it as it is (a one-off override is theirs
        # alone): no line, so that a bad input to them is the one error line
        before = config
        if overrides:
            recorded = run_record.merged((run_record.read(args.workdir) or {})["overrides"], [])
            before = load_config(got.spec, recorded)
        line = run_record.describe(
            args.workdir, got, overrides, before, config, explicit=args.config is not None
        )
        if line:
            print(f"realm-jax {args.command}: {line}", file=sys.stderr)
    args.config, args.overrides = got.spec, got.overrides
    return config


def default_retriever(config) -> str:
    """`evaluate` and `ask`'s retriever when --retriever is not given: the config's
    qa.retriever (configs/orqa.py: dense, own's hybrid), dense for a config without one."""
    qa = config.get("qa", None)
    return str(qa.get("retriever", "dense")) if qa is not None else "dense"


def _is_process_0(args) -> bool:
    if args.multihost:
        import jax

        return jax.process_index() == 0
    return int(args.process_id) == 0


def _run(args, overrides: list[str]) -> int:
    from realm_jax.config import validate

    if args.command == "sweep":  # its points run as other commands, in subprocesses
        from realm_jax.config import default_config_path
        from realm_jax.sweep.commands import command

        args.config = args.config or f"{default_config_path()}:smoke"
        return command(args, overrides)
    config = _resolve_config(args, overrides)
    from realm_jax.interop import sentence_embedder

    note = sentence_embedder.resolve(config, getattr(args, "overrides", overrides))
    if note:  # model.init_retriever_from's fields
        print(f"realm-jax {args.command}: {note}", file=sys.stderr)
    validate(config)  # every value, before any work
    if getattr(args, "retriever", "") is None:  # evaluate, ask without --retriever
        args.retriever = default_retriever(config)
    from realm_jax import fs

    fs.check_buckets([args.workdir, *fs.urls_in(config.to_dict())])  # every gs:// bucket named
    module, function = entry_point(args.command, config).split(":")
    if args.command == "ict":
        from realm_jax.data import versions  # ICT reads the prepared corpus only

        versions.refuse_ict(args.workdir)
    from realm_jax import runtime

    runtime.setup(args)
    runtime.compilation_cache(config.mesh.get("compilation_cache_dir", ""))
    from realm_jax.ops import mips

    mips.set_default_chunk(int(config.mesh.get("mips_chunk", mips.DEFAULT_CHUNK)))
    from realm_jax.train.loop import TrainingStopped

    records = args.command in RECORDS_CONFIG and _is_process_0(args)
    if records:  # before any work, so that a crash leaves it (unfinished: run_record.settled),
        # but never over the record of a trainer that holds the workdir (this one is refused)
        from realm_jax import run_record
        from realm_jax.lock import held_elsewhere

        records = args.command not in WATCHED or not held_elsewhere(args.workdir, "trainer")
    if records and args.command in WATCHED:  # prepare and import: once they succeed (bad
        # input to them writes nothing, not even the workdir)
        run_record.write(args.workdir, args.config, args.overrides, args.command, False)
    if args.command in WATCHED:  # from start-up to shut-down (watchdog.for_process)
        from realm_jax import watchdog

        watchdog.for_process(config.train, f"{config.task} training step")
    try:
        rc = getattr(importlib.import_module(module), function)(config, args) or 0
    except TrainingStopped as e:
        print(f"realm-jax {args.command}: stopped: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if args.command in WATCHED:
            watchdog.release()
    if rc == 0 and records:  # what realm_jax.load(workdir) and the next command read back
        run_record.write(args.workdir, args.config, args.overrides, args.command, True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
