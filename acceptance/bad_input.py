"""Every bad-input case through the real CLI, into the "Bad input" section of docs/reliability.md.

    python acceptance/bad_input.py

Each case runs `python -m realm_jax ...` in a temporary folder (a corpus with a broken line, a
missing file, a mesh that does not divide the batch, ...) and records the one line the CLI
prints (`realm-jax <command>: error: <message>`) and its exit code. The file's other sections
(written by other scripts) are kept: only the text between ERRORS_BEGIN and ERRORS_END is
replaced. tests/integration/test_errors.py runs the same CASES.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "reliability.md")
HEADER = (
    "# Reliability\n\nHow realm-jax behaves when things go wrong. Every section is written by "
    "a script; rerun it to refresh its section.\n"
)
ERRORS_BEGIN = "<!-- errors:begin -->"
ERRORS_END = "<!-- errors:end -->"
# Tokens in a case's args, replaced by paths in its temporary folder when it runs.
TMP = "$TMP"  # the run's temporary folder (the inputs of write_inputs)
RUN = "$RUN"  # the case's own fresh workdir, $TMP/runs/<case name>
DATA = "$DATA"  # the prepared sample (prepare_sample), shared by the cases that need data


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: what it is, the CLI arguments that hit it, a fragment the message must
    contain, and the exit code (2: an expected error)."""

    name: str
    input: str  # what is wrong, for the table
    args: tuple[str, ...]  # after `python -m realm_jax`; TMP/RUN/DATA tokens are substituted
    expect: str  # must appear in the error line
    exit: int = 2
    hold_lock: bool = False  # another process holds the trainer lock on $RUN


RANDOM = ("--config.data.masking=random",)  # no spaCy: prepares in seconds


ORQA = ("--config", "configs/orqa.py:smoke")


def _train(*extra: str) -> tuple[str, ...]:
    return ("train", "--workdir", RUN, *extra)


def _with_data(command: str, *extra: str) -> tuple[str, ...]:
    return (command, "--workdir", RUN, f"--config.data.data_dir={DATA}", *extra)


CASES = (
    # ---------------------------------------------------------------- config
    Case(
        "unknown_config_key",
        "a misspelt override",
        _train("--config.train.lrr=1e-4"),
        "unknown config key 'train.lrr'; did you mean train.lr",
    ),
    Case(
        "override_type",
        "an override of the wrong type",
        _train("--config.train.steps=abc"),
        "--config.train.steps: expected an integer, got 'abc'",
    ),
    Case(
        "unknown_variant",
        "a variant the config file does not have",
        _train("--config", "configs/realm.py:tiny"),
        "unknown variant 'tiny'; choose one of smoke, small, base, squad",
    ),
    Case(
        "config_not_python",
        "a config file that is not Python",
        _train("--config", "data/sample/README.md:smoke"),
        "is not a Python config file",
    ),
    Case(
        "config_missing",
        "a config file that does not exist",
        _train("--config", "configs/nope.py:smoke"),
        "config file not found: configs/nope.py",
    ),
    Case(
        "config_raises",
        "a config file whose code fails",
        _train("--config", f"{TMP}/broken.py"),
        "broken.py:2: ZeroDivisionError: division by zero",
    ),
    Case(
        "wrong_task_config",
        "`ict` with a REALM config",
        ("ict", "--workdir", RUN),
        "is a 'realm' config; use configs/ict.py",
    ),
    Case(
        "batch_size_zero",
        "train.batch_size=0",
        _train("--config.train.batch_size=0"),
        "train.batch_size=0: must be at least 1",
    ),
    Case(
        "num_candidates_one",
        "train.num_candidates=1",
        _train("--config.train.num_candidates=1"),
        "train.num_candidates=1: must be at least 2",
    ),
    Case(
        "refresh_mode",
        "an unknown refresh.mode",
        _train("--config.refresh.mode=async"),
        "refresh.mode='async': must be one of external, inprocess",
    ),
    Case(
        "masking",
        "an unknown data.masking",
        ("prepare", "--workdir", RUN, "--config.data.masking=ner"),
        "data.masking='ner': must be one of salient, random",
    ),
    Case(
        "eval_split_key",
        "an unknown data.eval_split_key",
        ("prepare", "--workdir", RUN, "--config.data.eval_split_key=article"),
        "data.eval_split_key='article': must be one of title, doc_id",
    ),
    Case(
        "eval_fraction_one",
        "data.eval_fraction=1 (nothing left to train on)",
        ("prepare", "--workdir", RUN, "--config.data.eval_fraction=1.0"),
        "data.eval_fraction=1.0: must be in [0, 1)",
    ),
    Case(
        "block_len_tiny",
        "data.block_len=3 (no room for text)",
        ("prepare", "--workdir", RUN, "--config.data.block_len=3"),
        "data.block_len=3: must be at least 8",
    ),
    Case(
        "block_len_positions",
        "data.block_len beyond the embedder's position table",
        _train("--config.data.block_len=512"),
        "data.block_len=512: must be at most model.embedder.max_position_embeddings (256)",
    ),
    Case(
        "heads",
        "a width not divisible by the heads",
        _train("--config.model.reader.num_heads=3"),
        "model.reader.hidden_size=64: must be divisible by model.reader.num_heads (3)",
    ),
    Case(
        "mesh_batch_static",
        "a mesh whose data axis does not divide the batch",
        _train("--config.mesh.shape=(3, 1)"),
        "train.batch_size=8: must be divisible by the mesh's data axis (3",
    ),
    Case(
        "mesh_batch_devices",
        "8 devices (mesh data axis -1) for a batch of 12",
        _train("--cpu_devices", "8", "--config.train.batch_size=12"),
        "train.batch_size 12 is not divisible by the mesh's data axis (8 of 8 devices",
    ),
    Case(
        "mesh_devices",
        "a mesh bigger than the job",
        _train("--cpu_devices", "2", "--config.mesh.shape=(2, 2)"),
        "mesh.shape (2, 2) needs 4 devices, the job has 2",
    ),
    # ---------------------------------------------------------------- corpus and data
    Case(
        "corpus_bad_line",
        "a corpus line that is not JSON",
        ("prepare", "--workdir", RUN, f"--config.data.corpus={TMP}/bad.jsonl"),
        "bad.jsonl:2: malformed JSON (Expecting property name enclosed in double quotes) "
        "(--config.data.skip_bad_input=true skips and counts such input)",
    ),
    Case(
        "corpus_missing",
        "a corpus path that does not exist",
        ("prepare", "--workdir", RUN, f"--config.data.corpus={TMP}/missing.jsonl"),
        "missing.jsonl': no such file or folder",
    ),
    Case(
        "corpus_format",
        "a corpus file of an unknown format",
        ("prepare", "--workdir", RUN, f"--config.data.corpus={TMP}/corpus.csv"),
        "unknown corpus format (use .jsonl, .tsv or a folder of .txt)",
    ),
    Case(
        "no_examples",
        "a corpus without a single salient span",
        ("prepare", "--workdir", RUN, f"--config.data.corpus={TMP}/no_entities.jsonl"),
        "no pre-training examples: no sentence of 1 has a usable salient span",
    ),
    Case(
        "train_before_prepare",
        "`train` on a workdir with no prepared data",
        _train(),
        "holds no prepared data: no summary.json. Run `realm-jax prepare`",
    ),
    Case(
        "prepared_other_lengths",
        "data prepared with another data.block_len",
        _with_data("train", "--config.data.block_len=64"),
        "data.block_len is 64 but",
    ),
    Case(
        "vocab_below_data",
        "a model.vocab_size below the prepared data's vocabulary",
        _with_data("train", "--config.model.vocab_size=512"),
        "model.vocab_size=512 is smaller than the vocabulary of the token ids prepared in",
    ),
    Case(
        "num_candidates_too_many",
        "more candidates than the corpus has blocks",
        _with_data("train", "--cpu_devices", "8", "--config.train.num_candidates=1000"),
        "train.num_candidates=1000: must be at least 2 and at most",
    ),
    Case(
        "batch_bigger_than_data",
        "an eval batch bigger than the held-out set",
        _with_data("train", "--config.train.eval_batch_size=4096"),
        "cannot fill one evaluation batch of 4096",
    ),
    # ---------------------------------------------------------------- weights
    Case(
        "weights_missing",
        "model.init_embedder_from: no such folder",
        _with_data("train", f"--config.model.init_embedder_from={TMP}/no_such_model"),
        "no_such_model: no such folder",
    ),
    Case(
        "weights_pickle",
        "a weights folder holding only a pickle",
        _with_data("train", f"--config.model.init_reader_from={TMP}/pickled_model"),
        "pytorch_model.bin: not a zip archive: the legacy torch.save format (before PyTorch "
        "1.6) is not read, as its pickles are never loaded",
    ),
    Case(
        "ict_warm_start_missing",
        "model.init_embedders_from_ict: not an ICT workdir",
        _with_data("train", f"--config.model.init_embedders_from_ict={TMP}"),
        "no checkpoints folder there (give the workdir of a `realm-jax ict` run)",
    ),
    # ---------------------------------------------------------------- ask and the workdir
    Case(
        "ask_before_training",
        "`ask` before any training",
        _with_data("ask", "Who founded the Ming dynasty?"),
        "train first (`realm-jax local`, or `train` with `refresh`)",
    ),
    Case(
        "ask_top_k",
        "`ask --top_k 0`",
        _with_data("ask", "--top_k", "0", "Who?"),
        "--top_k must be at least 1, got 0",
    ),
    Case(
        "ask_empty_question",
        "`ask` with an empty question",
        _with_data("ask", ""),
        "question is empty: give some text",
    ),
    Case(
        "ask_blank_question_qa",
        "`ask` with a question of spaces (a QA config)",
        _with_data("ask", *ORQA, "   "),
        "question is empty (whitespace only): give some text",
    ),
    Case(
        "ask_no_question",
        "`ask` without a question",
        _with_data("ask"),
        "give a question (interactive mode needs a QA config)",
    ),
    # ---------------------------------------------------------------- open-domain QA
    Case(
        "questions_bad_json",
        "a question file line that is not JSON",
        _with_data("evaluate", *ORQA, "--questions", f"{TMP}/bad_questions.jsonl"),
        "bad_questions.jsonl:2: invalid JSON",
    ),
    Case(
        "questions_bad_tsv",
        "a CuratedTREC line without its regex column",
        _with_data("evaluate", *ORQA, "--questions", f"{TMP}/bad_trec.tsv"),
        "bad_trec.tsv:1: 3 tab-separated column(s); expected 4",
    ),
    Case(
        "qa_beams",
        "a reader beam wider than the retriever beam",
        _with_data("finetune", *ORQA, "--config.qa.reader_beam_size=40"),
        "qa.reader_beam_size (40) must be between 1 and qa.retriever_beam_size (16)",
    ),
    Case(
        "qa_eval_beam",
        "an answering beam wider than the retriever beam",
        _with_data("finetune", *ORQA, "--config.qa.eval_reader_beam_size=40"),
        "qa.eval_reader_beam_size (40) must be between 0 (qa.reader_beam_size's) and "
        "qa.retriever_beam_size (16)",
    ),
    Case(
        "evaluate_negative_limit",
        "`evaluate --limit -1`",
        _with_data("evaluate", *ORQA, "--limit", "-1"),
        "--limit must be 0 (every question) or more, got -1",
    ),
    Case(
        "evaluate_unknown_checkpoint",
        "`evaluate --checkpoint` naming no checkpoint",
        _with_data("evaluate", *ORQA, "--checkpoint", "nope"),
        "unknown checkpoint 'nope': give best, latest, initial or a step number",
    ),
    Case(
        "evaluate_before_finetune",
        "`evaluate` on a workdir never fine-tuned",
        _with_data("evaluate", *ORQA),
        "run `realm-jax finetune` with this workdir first",
    ),
    Case(
        "workdir_locked",
        "a workdir another trainer holds",
        _train(),
        "is in use by another trainer",
        hold_lock=True,
    ),
    # ---------------------------------------------------------------- update (issue 61)
    Case(
        "update_bad_lines",
        "`update` CHANGES with a malformed line, a duplicate id and a delete line with text",
        ("update", "--workdir", RUN, *ORQA, "--corpus", f"{TMP}/bad_changes.jsonl"),
        "bad_changes.jsonl:2: malformed JSON",
    ),
    Case(
        "update_binary_text",
        "`update` CHANGES whose text is binary (NUL bytes)",
        ("update", "--workdir", RUN, *ORQA, "--corpus", f"{TMP}/binary_changes.jsonl"),
        "binary_changes.jsonl:1: binary text (NUL or control bytes)",
    ),
    Case(
        "overwrite_trained_workdir",
        "`prepare --overwrite` of changed input under existing checkpoints and index",
        ("prepare", "--workdir", f"{TMP}/trained", "--overwrite", *RANDOM, "--config.data.seed=1"),
        "were built from the old data",
        exit=0,
    ),
)


# ------------------------------------------------------------------------------------ inputs
def write_inputs(tmp: str) -> None:
    """The bad inputs the cases name, in `tmp`."""
    good = {"title": "Ming dynasty", "text": "The Ming dynasty was founded in 1368."}
    with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
        f.write(json.dumps(good) + "\n{title: 'no quotes'}\n")
    with open(os.path.join(tmp, "corpus.csv"), "w") as f:
        f.write("title,text\nA,Some text.\n")
    with open(os.path.join(tmp, "no_entities.jsonl"), "w") as f:
        f.write(json.dumps({"title": "cat", "text": "the cat sat on the mat and was happy."}))
    with open(os.path.join(tmp, "broken.py"), "w") as f:
        f.write("def get_config(arg=None):\n    return 1 / 0\n")
    with open(os.path.join(tmp, "bad_questions.jsonl"), "w") as f:
        f.write('{"question": "who?", "answer": ["x"]}\n{"question": "who?", answer}\n')
    with open(os.path.join(tmp, "bad_trec.tsv"), "w") as f:
        f.write("1\tfactoid\tHow tall is Mount McKinley?\n")
    with open(os.path.join(tmp, "bad_changes.jsonl"), "w") as f:
        f.write(json.dumps({"id": "a", **good}) + "\n{id: 'b'}\n")
        f.write(json.dumps({"id": "a", **good}) + "\n")
        f.write(json.dumps({"id": "c", "delete": True, "text": "x"}) + "\n")
    with open(os.path.join(tmp, "binary_changes.jsonl"), "w") as f:
        f.write(json.dumps({"id": "a", "title": "T", "text": "\u0000\u0001\u0002 data"}) + "\n")
    pickled = os.path.join(tmp, "pickled_model")
    os.makedirs(pickled, exist_ok=True)
    with open(os.path.join(pickled, "config.json"), "w") as f:
        json.dump({"model_type": "bert"}, f)
    with open(os.path.join(pickled, "pytorch_model.bin"), "wb") as f:
        f.write(b"a pickle: never loaded")


def env() -> dict[str, str]:
    """The CLI's environment: CPU, no fake devices unless a case asks (--cpu_devices)."""
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out["JAX_PLATFORMS"] = "cpu"
    return out


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prepare_sample(folder: str) -> str:
    """The bundled sample prepared into folder/data (random masking: no spaCy, seconds);
    returns the data folder."""
    out = cli("prepare", "--workdir", folder, *RANDOM)
    if out.returncode:
        raise RuntimeError(f"preparing the sample failed:\n{out.stderr[-3000:]}")
    return os.path.join(folder, "data")


def make_trained(tmp: str, data: str) -> str:
    """A workdir with prepared data, a checkpoint and an index folder (contents faked): what
    `prepare --overwrite` must warn about."""
    work = os.path.join(tmp, "trained")
    shutil.copytree(data, os.path.join(work, "data"))
    os.makedirs(os.path.join(work, "checkpoints", "0"))
    os.makedirs(os.path.join(work, "index", "step_00000000"))
    return work


HOLD = (
    "import sys, time\nfrom realm_jax.lock import workdir_lock\n"
    "with workdir_lock(sys.argv[1], 'trainer'):\n    print('HELD', flush=True)\n"
    "    time.sleep(600)\n"
)


@contextlib.contextmanager
def held(workdir: str):
    """Another process holding the trainer lock on workdir for the body."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, workdir], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        if proc.stdout.readline().strip() != "HELD":
            raise RuntimeError("the lock holder did not start")
        yield
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# --------------------------------------------------------------------------------------- run
@dataclasses.dataclass
class Result:
    case: Case
    returncode: int
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        """stderr's lines that start with `realm-jax ` (the CLI's own)."""
        return [line for line in self.stderr.splitlines() if line.startswith("realm-jax ")]


def run_case(case: Case, tmp: str, data: str | None = None, verbose: bool = False) -> Result:
    """Run one case in `tmp` (write_inputs done; `data` the prepared sample, for the cases
    naming $DATA; make_trained done, for the overwrite case)."""
    run = os.path.join(tmp, "runs", case.name)  # a fresh workdir per case
    args = [a.replace(DATA, data or "").replace(RUN, run).replace(TMP, tmp) for a in case.args]
    if verbose:
        args.insert(1, "-v")
    t0 = time.time()
    lock = held(run) if case.hold_lock else contextlib.nullcontext()
    with lock:
        out = cli(*args)
    return Result(case, out.returncode, out.stderr, time.time() - t0)


def shown(text: str, tmp: str) -> str:
    """A path-independent rendering for the table."""
    return text.replace(tmp, "$TMP").replace(REPO + os.sep, "").replace(REPO, ".")


def _code(text: str) -> str:
    """Inline code that may itself hold backticks (CommonMark: a longer fence, padded)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(results: list[Result], tmp: str) -> str:
    rows = [
        "| input | command | message | exit |",
        "|---|---|---|---|",
    ]
    for r in results:
        args = [a.replace(DATA, "$TMP/sample/data").replace(RUN, "$TMP/run") for a in r.case.args]
        command = "realm-jax " + " ".join(f'"{a}"' if " " in a or not a else a for a in args)
        message = r.lines[-1] if r.lines else "(no realm-jax line)"
        message = shown(message, tmp).replace(f"$TMP/runs/{r.case.name}", "$TMP/run")
        cells = [r.case.input, _code(command), _code(message), str(r.returncode)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def write_section(body: str) -> None:
    """Replace the text between ERRORS_BEGIN and ERRORS_END in docs/reliability.md (or
    append the section), keeping every other section."""
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    text = open(DOC).read() if os.path.exists(DOC) else HEADER
    block = f"{ERRORS_BEGIN}\n{body.strip()}\n{ERRORS_END}"
    pattern = re.compile(re.escape(ERRORS_BEGIN) + r".*?" + re.escape(ERRORS_END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote the bad-input section of {DOC}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="realm-jax-errors-") as tmp:
        write_inputs(tmp)
        data = prepare_sample(os.path.join(tmp, "sample"))
        make_trained(tmp, data)
        results, bad = [], []
        for case in CASES:
            r = run_case(case, tmp, data)
            results.append(r)
            ok = r.returncode == case.exit and any(case.expect in line for line in r.lines)
            if case.exit == 2:
                ok = ok and len(r.lines) == 1 and "Traceback" not in r.stderr
            print(f"{'ok ' if ok else 'BAD'} {case.name:<28} exit {r.returncode} {r.seconds:5.1f}s")
            if not ok:
                bad.append(case.name)
                print(r.stderr[-3000:])
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        body = (
            "## Bad input\n\n"
            f"_Run {stamp} by `python acceptance/bad_input.py` on {platform.machine()}, "
            f"Python {platform.python_version()}; `$TMP` is its temporary folder._\n\n"
            "Every expected error (bad input, config, data, weights, workdir) is one line on "
            "stderr, `realm-jax <command>: error: <message>`, with exit code 2; `-v` adds the "
            "traceback. An unexpected exception keeps its traceback and exits 1. The cases "
            "below run before any model is compiled or any checkpoint is written (the last "
            "row is a warning, not an error: the data is rebuilt). "
            "tests/integration/test_errors.py runs the same cases.\n\n" + table(results, tmp)
        )
        write_section(body)
    if bad:
        print("unexpected results:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
