"""The pod rehearsal's stages (acceptance/pod_rehearsal.py): each runs one step of the chain as a
2-process job on gs:// and as 1 process on local disk, and says what it compared."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

from acceptance.pod_jobs import REPO, Job, compare_curves, run, wait_until
from realm_jax import fs
from realm_jax.train.metrics import read_scalars

BUCKET = "realm-pod-rehearsal"
GS = f"gs://{BUCKET}"
BERT_TINY = os.path.join(os.path.dirname(REPO), "shared", "models", "bert-tiny-mlm")
LOSS_TOL = 1e-5
KILL_BOUND = 120.0  # seconds the surviving process may take to exit after a peer's kill -9
SAMPLE = os.path.join(REPO, "data", "sample")
TINY_BERT = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    intermediate_size=512,
    hidden_act="gelu",
    max_position_embeddings=512,
)


@dataclasses.dataclass
class Row:
    stage: str
    procs: str
    wall: float
    compared: str
    ok: bool
    result: str
    fatal: bool = True  # a later stage needs this one


@dataclasses.dataclass
class Plan:
    """Where everything lives, and the chain's sizes."""

    root: str  # local: the reference chain, logs, host caches
    quick: bool
    ict_steps: int
    realm_steps: int
    every: int  # REALM: refresh.every = train.checkpoint_every
    qa_steps: int
    weights: str  # "" (random init) or the HF folder the chain starts from
    env: dict = dataclasses.field(default_factory=dict)
    background: list = dataclasses.field(default_factory=list)

    @classmethod
    def make(cls, root: str, quick: bool) -> Plan:
        weights = BERT_TINY if os.path.isdir(BERT_TINY) else ""
        if quick:
            return cls(root, True, 4, 6, 3, 4, weights)
        return cls(root, False, 12, 20, 5, 16, weights)

    def pod(self, name: str) -> str:
        return f"{GS}/pod/{name}"

    def ref(self, name: str) -> str:
        return os.path.join(self.root, "ref", name)

    def stop_background(self) -> None:
        for job in self.background:
            job.kill()
        self.background.clear()


def _model_overrides(plan: Plan) -> list[str]:
    if not plan.weights:
        return []
    return [
        f"--config.model.{part}.{k}={v}"
        for part in ("embedder", "reader")
        for k, v in TINY_BERT.items()
    ]


def _common(plan: Plan, data_dir: str) -> list[str]:
    return [
        f"--config.data.data_dir={data_dir}",
        "--config.train.log_every=1",
        "--config.refresh.build_scann=false",
        *_model_overrides(plan),
    ]


def _both(plan: Plan, name: str, pod_args: list[str], ref_args: list[str], timeout=900):
    """The stage as 2 x 2 on gs:// and as 1 x 4 locally: (pod job, reference job)."""
    pod = run(
        f"{name}-pod", pod_args, procs=2, devices=2, root=plan.root, env=plan.env, timeout=timeout
    )
    ref = run(
        f"{name}-ref", ref_args, procs=1, devices=4, root=plan.root, env=plan.env, timeout=timeout
    )
    return pod, ref


def _curve_row(stage, pod_dir, ref_dir, wall, tags=("loss",), after: int = 0) -> Row:
    """Curves compared at every step past `after` (a resumed run: the steps a killed run
    trained before its checkpoint may be missing from its event file, which a gs:// workdir
    uploads every 60 s)."""
    a, b = read_scalars(pod_dir), read_scalars(ref_dir)
    results, ok = [], True
    for tag in tags:
        mine = {s: v for s, v in a.get(tag, {}).items() if s > after}
        theirs = {s: v for s, v in b.get(tag, {}).items() if s > after}
        good, text = compare_curves(mine, theirs, LOSS_TOL)
        ok &= good
        results.append(f"{tag}: {text}")
    return Row(
        stage,
        "2x2 gs:// / 1x4 local",
        wall,
        f"{', '.join(tags)} to {LOSS_TOL:g} (relative above 1)",
        ok,
        "; ".join(results),
    )


def _from_pod(plan: Plan, name: str) -> str:
    """A local copy of the pod chain's workdir `name` (its checkpoints): the reference stage
    starts from the same weights as the pod stage, so each stage is compared on its own
    (differences of ~1e-6 from an earlier stage would otherwise add up along the chain)."""
    local = plan.ref(f"from-pod/{name}")
    if not os.path.isdir(local):
        src = plan.pod(name)
        rels = [r for r in fs.walk_files(src) if r.startswith("checkpoints/")]
        fs.download_tree(src, local, rels)
    return local


# ------------------------------------------------------------------------------- stages


def stage_inputs(plan: Plan) -> list[Row]:
    """The user's inputs on gs://: the corpus, the question file, the BERT weights."""
    t0 = time.time()
    fs.upload_tree(SAMPLE, f"{GS}/input", skip=("README.md",))
    if plan.weights:
        fs.upload_tree(plan.weights, f"{GS}/weights/bert-tiny")
    what = "corpus, questions" + (
        ", bert-tiny weights" if plan.weights else " (no ../shared: random init)"
    )
    return [Row("inputs to gs://", "-", time.time() - t0, "-", True, what)]


def stage_prepare(plan: Plan) -> list[Row]:
    from tests.support.runs import prepared_records as _records

    engine = "local" if plan.quick else "beam"
    pod = run(
        "prepare-pod",
        [
            "prepare",
            "--workdir",
            plan.pod("run"),
            f"--config.data.corpus={GS}/input/corpus.jsonl",
            f"--config.data.engine={engine}",
        ],
        procs=1,
        devices=1,
        root=plan.root,
        env=plan.env,
    )
    ref = run(
        "prepare-ref",
        [
            "prepare",
            "--workdir",
            plan.ref("run"),
            f"--config.data.corpus={SAMPLE}/corpus.jsonl",
            "--config.data.engine=local",
        ],
        procs=1,
        devices=1,
        root=plan.root,
        env=plan.env,
    )
    a, b = _records(plan.pod("run/data")), _records(plan.ref("run/data"))
    bad = [
        f"{name}[{i}].{k}"
        for name in a.keys() | b.keys()
        for i, (x, y) in enumerate(zip(a.get(name, []), b.get(name, []), strict=False))
        for k in x
        if not _same(x[k], y.get(k))
    ]
    counts = {k: len(v) for k, v in a.items()}
    ok = not bad and counts == {k: len(v) for k, v in b.items()}
    result = f"{counts}" if ok else f"differ: {bad[:4]}"
    return [
        Row(
            f"prepare ({engine} -> gs://)",
            "1 (Beam: 2 workers)" if engine == "beam" else "1",
            pod.wall + ref.wall,
            "every record",
            ok,
            result,
        )
    ]


def _same(x, y) -> bool:
    import numpy as np

    return np.array_equal(np.asarray(x), np.asarray(y))


def _ict_args(plan: Plan, workdir: str, data_dir: str, weights: str) -> list[str]:
    n = plan.ict_steps
    args = [
        "ict",
        "--config",
        "configs/ict.py:smoke",
        "--workdir",
        workdir,
        *_common(plan, data_dir),
        f"--config.train.steps={n}",
        f"--config.train.eval_every={n // 2}",
        f"--config.train.checkpoint_every={n // 2}",
        "--config.train.eval_examples=64",
    ]
    return args + ([f"--config.model.init_embedder_from={weights}"] if weights else [])


def stage_ict(plan: Plan) -> list[Row]:
    w_pod = f"{GS}/weights/bert-tiny" if plan.weights else ""
    pod, ref = _both(
        plan,
        "ict",
        _ict_args(plan, plan.pod("ict"), plan.pod("run/data"), w_pod),
        _ict_args(plan, plan.ref("ict"), plan.ref("run/data"), plan.weights),
    )
    row = _curve_row("ict (eval on)", plan.pod("ict"), plan.ref("ict"), pod.wall + ref.wall)
    # Held-out recall is reported, not held to 1e-5: ICT's tiny gradients sum in another order
    # on 2 processes (its norm differs by ~1e-6), which can move a query or two past a neighbour.
    a, b = read_scalars(plan.pod("ict")), read_scalars(plan.ref("ict"))
    tag = "eval/recall_at_5"
    steps = sorted(set(a.get(tag, {})) & set(b.get(tag, {})))
    row.result += "; recall@5 " + ", ".join(
        f"step {s}: {a[tag][s]:.3f}/{b[tag][s]:.3f}" for s in steps
    )
    row.ok &= bool(steps) and a[tag][0] == b[tag][0]
    return [row]


def _realm_args(
    plan: Plan, workdir: str, data_dir: str, ict: str, weights: str, mode: str
) -> list[str]:
    n, every = plan.realm_steps, plan.every
    args = [
        "train",
        "--config",
        "configs/realm.py:smoke",
        "--workdir",
        workdir,
        *_common(plan, data_dir),
        f"--config.train.steps={n}",
        f"--config.train.checkpoint_every={every}",
        f"--config.refresh.every={every}",
        f"--config.train.eval_every={n}",
        f"--config.model.init_embedders_from_ict={ict}",
        f"--config.refresh.mode={mode}",
        "--config.train.keep_checkpoints=10",
        "--config.refresh.poll_seconds=0.5",
    ]
    if mode == "external":
        args.append("--config.refresh.lockstep=true")
    return args + ([f"--config.model.init_reader_from={weights}"] if weights else [])


def _refresher(plan: Plan, name: str, workdir: str) -> Job:
    """The refresh job as its own 2-process job (a second slice), watching `workdir`."""
    args = _realm_args(plan, workdir, plan.pod("run/data"), "", "", "external")
    args[0] = "refresh"
    args = [a for a in args if "init_" not in a]
    job = Job(name, args, procs=2, devices=2, root=plan.root, env=plan.env)
    plan.background.append(job)
    return job


def _pod_realm(plan: Plan, workdir: str) -> list[str]:
    w = f"{GS}/weights/bert-tiny" if plan.weights else ""
    return _realm_args(plan, workdir, plan.pod("run/data"), plan.pod("ict"), w, "external")


def stage_realm(plan: Plan) -> list[Row]:
    refresher = _refresher(plan, "refresh-pod", plan.pod("realm"))
    t0 = time.time()
    pod = run(
        "realm-pod",
        _pod_realm(plan, plan.pod("realm")),
        procs=2,
        devices=2,
        root=plan.root,
        env=plan.env,
    )
    refresher.terminate()
    plan.background.remove(refresher)
    swaps = pod.text(0).count("index: now using version")
    run(
        "realm-ref",
        _realm_args(
            plan,
            plan.ref("realm"),
            plan.ref("run/data"),
            _from_pod(plan, "ict"),
            plan.weights,
            "inprocess",
        ),
        procs=1,
        devices=4,
        root=plan.root,
        env=plan.env,
    )
    row = _curve_row(
        "realm + refresh job (2 x 2 each)", plan.pod("realm"), plan.ref("realm"), time.time() - t0
    )
    want = plan.realm_steps // plan.every + 1
    row.result += f"; {swaps} index versions taken up (want {want})"
    row.ok &= swaps == want
    return [row]


def _checkpoints(workdir: str) -> list[int]:
    return sorted(int(n) for n in fs.listdir(fs.join(workdir, "checkpoints")) if n.isdigit())


def _killed_run(plan: Plan, name: str, kill: tuple[int, ...]):
    """A 2-process REALM run with its refresh job; kill -9 the trainer processes `kill` once
    checkpoint 2 * every exists. (workdir, refresher, the time the other took to exit)."""
    workdir = plan.pod(name)
    refresher = _refresher(plan, f"refresh-{name}", workdir)
    job = Job(
        f"{name}-1", _pod_realm(plan, workdir), procs=2, devices=2, root=plan.root, env=plan.env
    )
    target = 2 * plan.every
    wait_until(
        lambda: any(s >= target for s in _checkpoints(workdir)) or not all(job.alive()),
        600,
        f"checkpoint {target} in {workdir}",
    )
    t_kill = time.time()
    for i in kill:
        job.kill9(i)
    codes = job.wait(KILL_BOUND + 30)
    return workdir, refresher, job, codes, time.time() - t_kill


def stage_kill(plan: Plan) -> list[Row]:
    t0 = time.time()
    workdir, refresher, job, codes, took = _killed_run(plan, "realm-kill", (1,))
    bounded = took <= KILL_BOUND and codes[0] != 0
    first = (
        f"process 1 killed at checkpoint >= {2 * plan.every}: process 0 exited {codes[0]} "
        f"after {took:.0f} s"
    )
    again = run(
        "realm-kill-2", _pod_realm(plan, workdir), procs=2, devices=2, root=plan.root, env=plan.env
    )
    refresher.terminate()
    plan.background.remove(refresher)
    found = re.search(r"resumed from checkpoint (\d+)", again.text(0))
    after = int(found.group(1)) if found else 0
    row = _curve_row(
        "kill -9 one trainer process, relaunch",
        workdir,
        plan.pod("realm"),
        time.time() - t0,
        after=after,
    )
    row.procs, row.compared = "2x2 gs://", f"exit <= {KILL_BOUND:.0f} s; losses vs uninterrupted"
    row.result = f"{first}; relaunch resumed from checkpoint {after}, steps after it: {row.result}"
    row.ok &= bounded and found is not None
    row.fatal = False
    return [row]


def stage_resume_other_count(plan: Plan) -> list[Row]:
    t0 = time.time()
    workdir, refresher, _, _, _ = _killed_run(plan, "realm-count", (0, 1))
    job = Job(
        "realm-count-2", _pod_realm(plan, workdir), procs=1, devices=4, root=plan.root, env=plan.env
    )
    code = job.wait(600)[0]
    refresher.terminate()
    plan.background.remove(refresher)
    text = job.text(0)
    lines = [ln for ln in text.splitlines() if ln.startswith("realm-jax ")]
    if code == 0:
        found = re.search(r"resumed from checkpoint (\d+)", text)
        after = int(found.group(1)) if found else 0
        row = _curve_row(
            "resume 2 processes -> 1", workdir, plan.pod("realm"), time.time() - t0, after=after
        )
        row.procs = "2x2 -> 1x4 gs://"
        row.result = f"continued from checkpoint {after}: steps after it, {row.result}"
        row.ok &= found is not None
    else:
        ok = code == 2 and len(lines) == 1 and "process" in lines[0]
        row = Row(
            "resume 2 processes -> 1",
            "2x2 -> 1x4 gs://",
            time.time() - t0,
            "continues, or one line + exit 2",
            ok,
            f"exit {code}: {lines[-1] if lines else text.strip().splitlines()[-1]}",
        )
    row.fatal = False
    return [row]


def _qa_args(plan: Plan, workdir: str, data_dir: str, realm: str, questions: str) -> list[str]:
    n = plan.qa_steps
    return [
        "finetune",
        "--config",
        "configs/orqa.py:smoke",
        "--workdir",
        workdir,
        *_common(plan, data_dir),
        f"--config.train.steps={n}",
        f"--config.train.checkpoint_every={n // 2}",
        f"--config.train.eval_every={n // 2}",
        f"--config.model.init_from_realm={realm}",
        f"--config.qa.train_file={questions}",
        f"--config.qa.dev_file={questions}",
    ]


def stage_finetune(plan: Plan) -> list[Row]:
    pod, ref = _both(
        plan,
        "finetune",
        _qa_args(
            plan, plan.pod("qa"), plan.pod("run/data"), plan.pod("realm"), f"{GS}/input/qa.jsonl"
        ),
        _qa_args(
            plan,
            plan.ref("qa"),
            plan.ref("run/data"),
            _from_pod(plan, "realm"),
            f"{SAMPLE}/qa.jsonl",
        ),
    )
    return [
        _curve_row(
            "finetune (warm start from gs:// REALM)",
            plan.pod("qa"),
            plan.ref("qa"),
            pod.wall + ref.wall,
            ("loss", "eval/exact_match"),
        )
    ]


def _eval_args(plan: Plan, workdir: str, data_dir: str, questions: str, out: str) -> list[str]:
    args = _qa_args(plan, workdir, data_dir, "", questions)
    limit = 64 if plan.quick else 512  # the first N questions of the file
    return [
        "evaluate",
        *args[1:],
        f"--questions={questions}",
        f"--output={out}",
        f"--limit={limit}",
    ]


def stage_evaluate(plan: Plan) -> list[Row]:
    out_pod, out_ref = f"{GS}/pod/eval/qa", plan.ref("eval/qa")
    pod, ref = _both(
        plan,
        "evaluate",
        _eval_args(plan, plan.pod("qa"), plan.pod("run/data"), f"{GS}/input/qa.jsonl", out_pod),
        _eval_args(plan, plan.ref("qa"), plan.ref("run/data"), f"{SAMPLE}/qa.jsonl", out_ref),
    )
    m_pod = json.loads(fs.read_text(out_pod + ".metrics.json"))
    m_ref = json.loads(fs.read_text(out_ref + ".metrics.json"))
    preds = [
        [json.loads(ln)["prediction"] for ln in fs.read_text(o + ".predictions.jsonl").splitlines()]
        for o in (out_pod, out_ref)
    ]
    same = sum(a == b for a, b in zip(*preds, strict=True))
    keys = [k for k in m_ref if k.startswith(("exact", "recall"))]
    ok = all(abs(m_pod[k] - m_ref[k]) < 1e-9 for k in keys) and same == len(preds[1])
    result = (
        f"EM {m_pod['exact_match']:.4f} / {m_ref['exact_match']:.4f}, "
        f"{same}/{len(preds[1])} predictions equal, outputs on gs://"
    )
    return [
        Row(
            "evaluate (outputs to gs://)",
            "2x2 gs:// / 1x4 local",
            pod.wall + ref.wall,
            "EM, recall@k, every prediction",
            ok,
            result,
        )
    ]


def stage_ask(plan: Plan) -> list[Row]:
    q = "What did Aristotle write about?"
    answers = []
    t0 = time.time()
    for name, workdir, data in (
        ("pod", plan.pod("qa"), plan.pod("run/data")),
        ("ref", plan.ref("qa"), plan.ref("run/data")),
    ):
        args = [
            "ask",
            "--config",
            "configs/orqa.py:smoke",
            "--workdir",
            workdir,
            *_common(plan, data),
            q,
        ]
        job = run(f"ask-{name}", args, procs=1, devices=4, root=plan.root, env=plan.env)
        answers.append(
            next((ln for ln in job.text(0).splitlines() if ln.startswith("answer:")), "")
        )
    ok = bool(answers[0]) and answers[0] == answers[1]
    return [
        Row(
            "ask (gs:// workdir)",
            "1",
            time.time() - t0,
            "the answer line",
            ok,
            answers[0] or "no answer line",
        )
    ]


def stage_errors(plan: Plan) -> list[Row]:
    cases = [
        (
            "unreachable bucket",
            ["train", "--workdir", "gs://no-such-bucket-rehearsal/run"],
            1,
            "no-such-bucket-rehearsal",
        ),
        (
            "gs:// workdir with no checkpoints",
            ["evaluate", "--config", "configs/orqa.py:smoke", "--workdir", f"{GS}/empty"]
            + [f"--config.data.data_dir={plan.pod('run/data')}"],
            1,
            "checkpoint",
        ),
        (
            "process count does not divide the batch",
            [
                "ict",
                "--config",
                "configs/ict.py:smoke",
                "--workdir",
                f"{GS}/pod/bad",
                f"--config.data.data_dir={plan.pod('run/data')}",
                "--config.mesh.shape=(1,-1)",
                "--config.train.batch_size=5",
            ],
            2,
            "2 processes",
        ),
    ]
    rows = []
    for name, args, procs, expect in cases:
        job = Job(
            "error-" + re.sub(r"[^a-z0-9]+", "-", name)[:24],
            args,
            procs=procs,
            devices=2,
            root=plan.root,
            env=plan.env,
        )
        codes = job.wait(300)
        lines = [ln for ln in job.text(0).splitlines() if ln.startswith("realm-jax ")]
        ok = (
            all(c == 2 for c in codes)
            and len(lines) == 1
            and expect in lines[0]
            and "Traceback" not in job.text(0)
        )
        rows.append(
            Row(
                f"bad input: {name}",
                str(procs),
                job.seconds,
                "one line, exit 2",
                ok,
                f"exit {codes}: {lines[-1] if lines else '(no realm-jax line)'}",
                fatal=False,
            )
        )
    return rows


def stages(plan: Plan):
    chain = [stage_inputs, stage_prepare, stage_ict, stage_realm]
    if not plan.quick:
        chain += [stage_kill, stage_resume_other_count]
    chain += [stage_finetune, stage_evaluate]
    if not plan.quick:
        chain += [stage_ask, stage_errors]
    return chain


def doc_text(plan: Plan, table: str, ok: bool, minutes: float) -> str:
    weights = "bert-tiny (../shared) read from gs://" if plan.weights else "random init"
    return f"""`make pod-rehearsal` (`python acceptance/pod_rehearsal.py`) runs the paper's chain as
a multi-host job: every multi-host command as 2 `jax.distributed` processes x 2 fake CPU devices,
each process with its own cache folder (a host's disk), the corpus, question file, weights,
data dir and workdirs on gs:// (fake-gcs-server, memory backend, on a loopback port). Each
stage is compared with the same stage run as 1 process x 4 devices on local disk, starting
from a local copy of the checkpoints the pod chain's previous stage wrote. Weights: {weights};
ICT {plan.ict_steps} steps, REALM {plan.realm_steps} steps (its refresh job a separate 2-process
job, `refresh.lockstep` swaps every {plan.every} steps, so the steps equal the reference's
in-process refresh), fine-tuning {plan.qa_steps} steps. Losses are compared at every step, to
{LOSS_TOL:g} (relative where a loss is above 1). The faults: kill -9 of one trainer process
once checkpoint {2 * plan.every} exists (the other must exit within {KILL_BOUND:.0f} s; JAX's
heartbeat, 30 s, ends it), then a relaunch of both; and a 2-process run killed whole and
resumed by 1 process x 4 devices (another host count). {"Passed" if ok else "FAILED"} in
{minutes:.1f} minutes (every process logs to ROOT/logs/; ROOT is runs/pod-rehearsal unless --root).

{table}
"""
