"""Gold passages on the bundled sample: the gold-block mapping against a brute-force scan,
qa.gold_in_beam in a direct qa_loss call and in a short fine-tuning run, `evaluate --retriever
gold`, `evaluate --checkpoint initial --retrieval_only` against a numpy brute force of the
warm start's retrieval, and the per-question hit flags against the summary recall@k."""

import argparse
import functools
import json
import os

import jax
import numpy as np
import pytest

from realm_jax import cli, sharding
from realm_jax import workdir as paths
from realm_jax.data import datasets, prepare
from realm_jax.index import store
from realm_jax.index.embedding import embed_query_tokens
from realm_jax.qa import commands as qa_commands
from realm_jax.qa import data as qa_data
from realm_jax.qa import step as qa_step
from realm_jax.qa.answers import read_questions
from realm_jax.qa.evaluation import FrozenIndex
from realm_jax.train.warm_start import params_hook
from tests.conftest import REPO
from tests.support.runs import QA_TITLES as TITLES
from tests.support.runs import qa_config as config

R = 3  # qa.reader_beam_size of test_qa_finetune's OVERRIDES


def _python_contains(row, answer) -> bool:
    row, answer = [int(t) for t in row], [int(t) for t in answer if t]
    n = len(answer)
    return bool(n) and any(row[p : p + n] == answer for p in range(len(row) - n + 1))


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """test_qa_finetune's two articles prepared (64-wordpiece blocks: passages cut into
    several), with its 16 training questions (SQuAD-style, with gold_passage)."""
    root = tmp_path_factory.mktemp("qa-gold")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        docs = [line for line in f if json.loads(line)["title"] in TITLES]
    with open(os.path.join(REPO, "data", "sample", "qa.jsonl")) as f:
        qs = [line for line in f if json.loads(line)["title"] in TITLES]
    (root / "corpus.jsonl").write_text("".join(docs))
    (root / "qa.jsonl").write_text("".join(qs[:16]))
    ddir = str(root / "prepared")
    prepare.prepare(config(root, ddir), ddir)
    return root, ddir


@pytest.fixture(scope="module")
def questions(sample):
    """Every question of the two articles (with its gold_passage), plus one whose gold passage
    is not in the corpus and one with none."""
    root, _ = sample
    with open(os.path.join(REPO, "data", "sample", "qa.jsonl")) as f:
        qs = [json.loads(line) for line in f if json.loads(line)["title"] in TITLES]
    assert qs and all(q["gold_passage"] for q in qs)
    qs.append({"question": "Where is nowhere?", "answers": ["there"], "gold_passage": "x/9"})
    qs.append({"question": "Who knows?", "answers": ["nobody"]})
    path = root / "gold.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in qs))
    return str(path)


@pytest.fixture(scope="module")
def run(sample, tmp_path_factory):
    """Two steps of fine-tuning with qa.gold_in_beam on (it publishes the frozen index from the
    initial document embedder) and the warm-start state built independently of evaluate."""
    root, ddir = sample
    work = str(tmp_path_factory.mktemp("gold") / "qa")
    extra = ("qa.gold_in_beam=True", "train.steps=2", "train.eval_every=0")
    cfg = config(root, ddir, *extra, "train.checkpoint_every=2")
    history = qa_commands.train(cfg, work)
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state, _ = qa_step.create_state(
        cfg, mesh, jax.random.key(cfg.train.seed), params_hook(cfg, span_head=True)
    )
    return cfg, work, history, model, state.params, mesh


def _evaluate(cfg, work, **kw):
    args = argparse.Namespace(
        config="configs/orqa.py:smoke",
        workdir=work,
        questions="",
        format="auto",
        limit=0,
        predictions="",
        retrieval_only=False,
        output="",
        checkpoint="best",
        retriever="dense",
    )
    for k, v in kw.items():
        setattr(args, k, v)
    assert qa_commands.evaluate(cfg, args) == 0
    metrics = json.load(open(args.output + ".metrics.json"))
    records = [json.loads(line) for line in open(args.output + ".predictions.jsonl")]
    return metrics, records


def test_gold_blocks_match_a_brute_force_scan(sample, questions):
    root, ddir = sample
    cfg = config(root, ddir)
    q = cfg.qa
    examples = read_questions(questions)
    assert examples[0].gold_passage.startswith("train/") and examples[-1].gold_passage == ""
    arrays, _ = qa_data.encode(examples, cfg.data.query_len, q.answer_len, q.max_answers)
    tokens, doc_ids, _ = datasets.load_blocks(ddir)
    lists, gold = qa_data.gold_blocks(examples, doc_ids, tokens, arrays["answer_ids"])
    multi = 0
    for n, ex in enumerate(examples):
        mine = [i for i in range(len(tokens)) if ex.gold_passage and doc_ids[i] == ex.gold_passage]
        has = [
            i for i in mine if any(_python_contains(tokens[i], a) for a in arrays["answer_ids"][n])
        ]
        assert lists[n] == tuple(has + [i for i in mine if i not in has]), ex.question
        assert gold[n] == (has[0] if has else -1)
        multi += len(mine) > 1
    assert multi > 0  # passages cut into several blocks are exercised
    assert (gold >= 0).mean() > 0.5 and (gold == -1).any()
    assert lists[-2] == lists[-1] == ()  # not in the corpus; no gold_passage at all
    # the host test is the device one (step.contains_answer) on every gold passage block
    pairs = [(n, b) for n, bl in enumerate(lists) for b in bl]
    dev = np.asarray(
        qa_step.contains_answer(
            np.stack([tokens[b] for _, b in pairs])[:, None],
            np.stack([arrays["answer_ids"][n] for n, _ in pairs]),
        )
    )[:, 0]
    host = [qa_data.holds_answer(tokens[b], arrays["answer_ids"][n]) for n, b in pairs]
    np.testing.assert_array_equal(dev, host)

    # the training arrays carry the gold block; the loader's batches too
    _, train_arrays = qa_data.training_questions(cfg, ddir)
    train = read_questions(cfg.qa.train_file)
    a2, _ = qa_data.encode(train, cfg.data.query_len, q.answer_len, q.max_answers)
    np.testing.assert_array_equal(
        train_arrays["gold_block"], qa_data.gold_blocks(train, doc_ids, tokens, a2["answer_ids"])[1]
    )
    batch = next(iter(qa_data.train_loader(cfg, train_arrays)))
    assert batch["gold_block"].shape == (cfg.train.batch_size,)


def test_gold_in_beam_puts_the_gold_block_in_the_read_beam(sample, run, questions):
    root, ddir = sample
    cfg, work, _, model, params, mesh = run
    tokens, doc_ids, _ = datasets.load_blocks(ddir)
    examples = read_questions(questions)
    arrays, _ = qa_data.encode(examples, cfg.data.query_len, cfg.qa.answer_len, cfg.qa.max_answers)
    _, gold = qa_data.gold_blocks(examples, doc_ids, tokens, arrays["answer_ids"])
    picked, seen = [], set()  # 7 questions with distinct gold blocks, and one with none
    shortest = np.where(arrays["answer_ids"] != 0, 1, 0).sum(-1)
    shortest = np.where(shortest > 0, shortest, 99).min(-1)  # wordpieces of the shortest answer
    for n in sorted(np.flatnonzero(gold >= 0), key=lambda n: (shortest[n], n)):
        if gold[n] not in seen and len(picked) < 7:
            picked.append(n)
            seen.add(gold[n])
    picked.append(len(examples) - 1)
    batch = {
        "question_ids": arrays["question_ids"][picked],
        "answer_ids": arrays["answer_ids"][picked],
        "gold_block": gold[picked],
    }
    assert (batch["gold_block"][:7] >= 0).all() and batch["gold_block"][7] == -1
    q = np.asarray(embed_query_tokens(model, params, batch["question_ids"]), np.float32)
    emb = store.load_embeddings(store.latest_valid(paths.index_dir(work))[1]).copy()
    for b in range(7):  # retrieval cannot find the gold block: the worst score of all
        emb[batch["gold_block"][b]] = -10.0 * q[b] / np.linalg.norm(q[b])
    index = FrozenIndex.put(mesh, emb, tokens)
    kw = qa_step.step_kwargs(cfg, mesh, len(tokens))
    assert kw["gold_in_beam"] is True and kw["beams"][1] == R
    out = {}
    for on in (False, True):
        kw["gold_in_beam"] = on
        loss = jax.jit(
            functools.partial(qa_step.qa_loss, model=model, rng=None, details=True, **kw)
        )
        _, m = loss(params, batch, index.emb, index.tokens)
        out[on] = {k: np.asarray(v) for k, v in m.items()}
    off, on = out[False], out[True]
    g = batch["gold_block"]
    for b in range(7):
        assert g[b] not in off["read_ids"][b]  # not retrieved
        assert on["read_ids"][b, R - 1] == g[b]  # inserted in the last slot
        np.testing.assert_allclose(
            on["read_relevance"][b, R - 1], q[b] @ emb[g[b]], rtol=1e-4, atol=1e-4
        )
    np.testing.assert_array_equal(on["read_ids"][:, : R - 1], off["read_ids"][:, : R - 1])
    np.testing.assert_array_equal(on["read_ids"][7], off["read_ids"][7])  # no gold: unaffected
    np.testing.assert_allclose(on["read_relevance"][7], off["read_relevance"][7], rtol=1e-6)
    assert on["gold_in_beam_rate"] == pytest.approx(7 / 8) and "gold_in_beam_rate" not in off
    assert on["retriever_loss"] == pytest.approx(off["retriever_loss"], rel=1e-5)  # ORQA's
    assert on["reader_oracle"] > off["reader_oracle"]  # supervised reads gained


def test_finetune_with_gold_in_beam_logs_its_rate(run):
    _, work, history, _, _, _ = run
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 2 and all(0 <= h["gold_in_beam_rate"] <= 1 for h in steps)
    assert any(h["gold_in_beam_rate"] > 0 for h in steps)  # a random retriever misses many


def test_evaluate_gold_reads_the_gold_passage(sample, run, questions, tmp_path):
    root, ddir = sample
    cfg, work, _, _, _, _ = run
    tokens, doc_ids, _ = datasets.load_blocks(ddir)
    examples = read_questions(questions)
    arrays, _ = qa_data.encode(examples, cfg.data.query_len, cfg.qa.answer_len, cfg.qa.max_answers)
    lists, _ = qa_data.gold_blocks(examples, doc_ids, tokens, arrays["answer_ids"])
    out = str(tmp_path / "gold")
    metrics, records = _evaluate(
        cfg, work, retriever="gold", checkpoint="latest", questions=questions, output=out
    )
    assert len(records) == len(examples) and metrics["questions"] == len(examples)
    assert metrics["gold_missing"] == 2 and not any(k.startswith("recall") for k in metrics)
    assert metrics["exact_match"] == np.mean([r["correct"] for r in records])
    for ex, rec, blocks in zip(examples, records, lists, strict=True):
        assert rec["question"] == ex.question
        if not blocks:
            assert rec["gold_missing"] and not rec["correct"] and rec["prediction"] == ""
            continue
        assert rec["block"]["id"] in blocks  # the prediction comes from the gold passage
        assert [b["id"] for b in rec["top_blocks"]] == list(blocks[:R])
        for b in rec["top_blocks"]:
            assert b["has_answer"] == qa_data.holds_answer(
                tokens[b["id"]], arrays["answer_ids"][examples.index(ex)]
            )
    covered = [any(b["has_answer"] for b in r["top_blocks"]) for r in records]
    assert metrics["gold_answer_coverage"] == pytest.approx(np.mean(covered))


def test_evaluate_initial_retrieval_is_the_warm_starts(sample, run, questions, tmp_path):
    root, ddir = sample
    cfg, work, _, model, params, _ = run
    out = str(tmp_path / "initial")
    metrics, records = _evaluate(
        cfg, work, checkpoint="initial", retrieval_only=True, questions=questions, output=out
    )
    assert metrics["checkpoint"] == "initial" and metrics["model"].startswith("initial")
    examples = read_questions(questions)
    arrays, _ = qa_data.encode(examples, cfg.data.query_len, cfg.qa.answer_len, cfg.qa.max_answers)
    tokens, _, _ = datasets.load_blocks(ddir)
    emb = store.load_embeddings(store.latest_valid(paths.index_dir(work))[1])
    q = np.asarray(embed_query_tokens(model, params, arrays["question_ids"]), np.float32)
    order = np.argsort(-(q @ emb.T), axis=1, kind="stable")
    ks = sorted(cfg.qa.recall_ks)
    for n, rec in enumerate(records):
        assert [b["id"] for b in rec["top_blocks"]] == order[n, :R].tolist()
        answers = arrays["answer_ids"][n]
        has = [any(_python_contains(tokens[i], a) for a in answers) for i in order[n, : max(ks)]]
        assert rec["hits"] == {str(k): any(has[:k]) for k in ks}
        assert [b["has_answer"] for b in rec["top_blocks"]] == has[:R]
    for k in ks:  # the summary is the mean of the per-question flags
        assert metrics[f"recall@{k}"] == pytest.approx(
            np.mean([r["hits"][str(k)] for r in records])
        )
    assert 0 < metrics[f"recall@{ks[-1]}"]

    # the fine-tuned checkpoint's dense evaluation carries the same flags, with reading
    metrics, records = _evaluate(cfg, work, checkpoint="latest", questions=questions, output=out)
    for k in ks:
        assert metrics[f"recall@{k}"] == pytest.approx(
            np.mean([r["hits"][str(k)] for r in records])
        )
    assert all(len(r["top_blocks"]) == R and "has_answer" in r["top_blocks"][0] for r in records)


def test_initial_publishes_the_warm_starts_index_and_the_cli_takes_the_new_options(
    sample, run, tmp_path
):
    """Zero-shot before any fine-tuning: `evaluate --checkpoint initial` in a workdir without an
    index embeds the warm start's corpus and publishes it: the same index `finetune` published
    at its start from the same warm start. The other checkpoints still need a fine-tuning."""
    cfg, work = run[0], run[1]
    fresh = str(tmp_path / "zeroshot")
    args = argparse.Namespace(
        config="configs/orqa.py:smoke",
        workdir=fresh,
        questions="",
        format="auto",
        limit=0,
        predictions="",
        retrieval_only=True,
        output="",
        checkpoint="initial",
        retriever="dense",
    )
    assert qa_commands.evaluate(cfg, args) == 0
    mine = store.load_embeddings(store.latest_valid(paths.index_dir(fresh))[1])
    theirs = store.load_embeddings(store.latest_valid(paths.index_dir(work))[1])
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    args.checkpoint, args.workdir = "latest", str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="run `realm-jax finetune` with this workdir"):
        qa_commands.evaluate(cfg, args)
    args.checkpoint = "initial"
    p = cli._parser()
    a = p.parse_args(
        ["evaluate", "--workdir", "w", "--retriever", "gold", "--checkpoint", "initial"]
    )
    assert (a.retriever, a.checkpoint) == ("gold", "initial")
    with pytest.raises(SystemExit):
        p.parse_args(["ask", "--workdir", "w", "--retriever", "gold"])
    args.retriever = "gold"  # nothing to retrieve: refused before any work
    assert qa_commands.evaluate(cfg, args) == 2


def test_dev_questions_are_spread_through_the_file(monkeypatch):
    """train.eval_examples dev questions are evenly spaced (a file groups an article's
    questions together: the first n came from a few articles): 10 questions, 4 picked ->
    positions 0, 2, 5, 7 (floor(i * 10 / 4)); 0 or more than the file: all of them."""
    import ml_collections

    file = [f"q{i}" for i in range(10)]
    monkeypatch.setattr(qa_data, "load_questions", lambda *a: list(file))
    cfg = ml_collections.ConfigDict(
        {"qa": {"dev_file": "", "format": "", "dev_holdout": ""}, "train": {"eval_examples": 4}}
    )
    assert qa_data.dev_questions(cfg, "") == ["q0", "q2", "q5", "q7"]
    for n in (0, 10, 25):
        cfg.train.eval_examples = n
        assert qa_data.dev_questions(cfg, "") == file


def test_a_reading_phase_step_differentiates_the_reader_alone(sample, run, questions):
    """train.embedder_lr_scale=0 (configs/orqa.py's reading phases): the compiled step takes
    no backward pass through the query embedder (XLA's FLOP count falls), and its new state is
    the full step's: the reader's update and Adam moments equal (gradient clipping far away,
    so the embedder's gradient does not join the reader's global norm), the embedders' weights
    bit-identical to before in both (the full step's zero updates)."""
    from realm_jax.train.optimizer import EMBEDDERS

    root, ddir = sample
    _, work, _, _, _, mesh = run
    cfg = config(root, ddir, "qa.gold_in_beam=True", "train.embedder_lr_scale=0.0",
                 "train.grad_clip=1e9", "train.warmup_steps=0")  # fmt: skip
    from realm_jax.config import load_config

    assert qa_step.reads_alone(cfg)
    assert not qa_step.reads_alone(load_config(os.path.join(REPO, "configs", "orqa.py:smoke")))
    tokens, doc_ids, _ = datasets.load_blocks(ddir)
    examples = read_questions(questions)[:8]
    arrays, _ = qa_data.encode(examples, cfg.data.query_len, cfg.qa.answer_len, cfg.qa.max_answers)
    _, gold = qa_data.gold_blocks(examples, doc_ids, tokens, arrays["answer_ids"])
    host = {k: arrays[k] for k in ("question_ids", "answer_ids")} | {"gold_block": gold}
    batch = sharding.global_batch(host, mesh)
    emb = store.load_embeddings(store.latest_valid(paths.index_dir(work))[1])
    index = FrozenIndex.put(mesh, emb, tokens)
    out, flops, before = {}, {}, None
    for alone in (False, True):  # a fresh state each time: the step donates it
        model, opt, state, shardings = qa_step.create_state(
            cfg, mesh, jax.random.key(0), params_hook(cfg, span_head=True)
        )
        if before is None:
            before = jax.device_get(state)
        fn = qa_step.compile_train_step(cfg, mesh, model, opt, shardings, len(tokens))
        if not alone:  # the step as it was before reads_alone
            fn = sharding.traced_in_mesh(
                jax.jit(
                    functools.partial(
                        qa_step.train_step, model=model, optimizer=opt, seed=cfg.train.seed,
                        frozen=qa_step.frozen_networks(cfg), reader_only_step=False,
                        **qa_step.step_kwargs(cfg, mesh, len(tokens)),
                    ),
                    donate_argnums=(0,),
                ),
                mesh,
            )  # fmt: skip
        cost = fn.lower(state, batch, index.emb, index.tokens).compile().cost_analysis()
        flops[alone] = (cost[0] if isinstance(cost, list) else cost)["flops"]
        out[alone] = jax.device_get(fn(state, batch, index.emb, index.tokens))
    assert flops[True] < 0.9 * flops[False], flops  # (tiny embedders here; MiniLM: most)
    (full, m_full), (alone, m_alone) = out[False], out[True]
    np.testing.assert_allclose(m_alone["loss"], m_full["loss"], rtol=1e-6)
    assert m_full["grad_norm/query_embedder"] > 0 and "grad_norm/query_embedder" not in m_alone
    np.testing.assert_allclose(m_alone["grad_norm/reader"], m_full["grad_norm/reader"], rtol=1e-5)

    def under(path):
        return any(getattr(k, "key", None) in EMBEDDERS for k in path)

    moved = 0
    for (path, a), b, o in zip(
        jax.tree_util.tree_leaves_with_path(full.params),
        jax.tree.leaves(alone.params),
        jax.tree.leaves(before.params),
        strict=True,
    ):
        if under(path):
            np.testing.assert_array_equal(a, o, err_msg=str(path))
            np.testing.assert_array_equal(b, o, err_msg=str(path))
        else:
            np.testing.assert_allclose(b - o, a - o, rtol=1e-4, atol=1e-9, err_msg=str(path))
            moved += bool(np.abs(a - o).max() > 0)
    assert moved > 0
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(full.opt_state),
        jax.tree.leaves(alone.opt_state),
        strict=True,
    ):
        if not under(path):  # the reader's moments, the counts
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-12, err_msg=str(path))
