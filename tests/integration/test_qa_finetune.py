"""ORQA fine-tuning end to end on two articles of the bundled sample: the loss falls, the best
dev checkpoint is kept, `evaluate` scores it with both retrievers, `ask` answers, and bad
configurations are refused before any work."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax import workdir as paths
from realm_jax.data import datasets
from realm_jax.index import store
from realm_jax.index.embedding import abstract_params
from realm_jax.qa import commands as qa_commands
from realm_jax.qa import data as qa_data
from realm_jax.qa import step as qa_step
from realm_jax.qa.evaluation import FrozenIndex
from tests.conftest import REPO
from tests.support.runs import QA_OVERRIDES as OVERRIDES
from tests.support.runs import qa_config as config


def _cli(root, ddir, workdir, *args, stdin=None):
    over = [f"--config.{o}" for o in OVERRIDES] + [
        f"--config.data.corpus={root / 'corpus.jsonl'}",
        f"--config.data.data_dir={ddir}",
        f"--config.qa.train_file={root / 'qa.jsonl'}",
        f"--config.qa.dev_file={root / 'qa.jsonl'}",
    ]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "realm_jax",
            *args,
            "--config",
            "configs/orqa.py:smoke",
            "--workdir",
            str(workdir),
            "--cpu_devices",
            "2",
            *over,
        ],
        cwd=REPO,
        capture_output=True,
        input=stdin,
        text=True,
        timeout=600,
    )


def _fixed_batch_loss(root, ddir, work, step):
    """ORQA's loss (no dropout) of checkpoint `step` on all 16 training questions at once."""
    cfg = config(root, ddir, "train.batch_size=16")
    mesh = sharding.make_mesh(cfg.mesh)
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    params = {}
    for name in ("query_embedder", "reader"):
        model, target = abstract_params(cfg, mesh, name)
        params[name] = checkpoint.restore_params_subtree(mgr, step, name, target)
    tokens, _, _ = datasets.load_blocks(ddir)
    index = FrozenIndex.put(
        mesh, store.load_embeddings(store.latest_valid(paths.index_dir(work))[1]), tokens
    )
    _, arrays = qa_data.training_questions(cfg, ddir)
    loss = jax.jit(
        functools.partial(
            qa_step.qa_loss, model=model, rng=None, **qa_step.step_kwargs(cfg, mesh, len(tokens))
        )
    )
    _, metrics = loss(params, arrays, index.emb, index.tokens)
    return {k: float(v) for k, v in metrics.items()}


def test_finetune_learns_keeps_the_best_and_evaluates(qa_files, tmp_path):
    _finetune_and_evaluate(qa_files, tmp_path)


@pytest.mark.system  # CI: CuratedTREC's regexes (unit/test_qa_answers.py), a predictions file
# rescored on gs:// (test_gcs_paths.py), `ask` (test_release_openqa.py)
def test_retrieval_only_rescoring_and_curatedtrec_evaluations(qa_files, tmp_path):
    root, ddir, work, metrics = _finetune_and_evaluate(qa_files, tmp_path)
    _more_evaluations(root, ddir, work, metrics, tmp_path)


def _finetune_and_evaluate(qa_files, tmp_path):
    """Fine-tunes on the sample's questions and evaluates (dense, bm25): (root, data dir,
    workdir, bm25's metrics)."""
    root, ddir = qa_files
    work = str(tmp_path / "qa")
    history = qa_commands.train(config(root, ddir), work)
    first, last = (_fixed_batch_loss(root, ddir, work, step) for step in (0, 60))
    assert last["reader_beam_recall"] == first["reader_beam_recall"] > 0  # the same questions
    assert last["reader_loss"] < 0.5 * first["reader_loss"], (first, last)
    assert last["exact_match"] > first["exact_match"], (first, last)
    # embedder_lr_scale 0: the step differentiates the reader alone (qa/step.py reads_alone;
    # the query embedder's gradient through ORQA's loss: test_qa_gold's full step)
    assert not any("grad_norm/query_embedder" in h for h in history)
    assert any(h.get("grad_norm/reader", 0) > 0 for h in history)
    evals = [h for h in history if "eval/exact_match" in h]
    assert [h["step"] for h in evals] == [0, 30, 60]
    assert evals[-1]["eval/exact_match"] > evals[0]["eval/exact_match"]  # learnt (train = dev)
    best = checkpoint.best_manager(paths.best_dir(work), "exact_match", read_only=True)
    ems = {h["step"]: h["eval/exact_match"] for h in evals}
    assert best.best_step() == max(ems, key=lambda s: (ems[s], s))  # a tie keeps the newest
    assert best.all_steps() == [best.best_step()]  # only the best one is kept

    for retriever in ("dense", "bm25", "hybrid"):
        weight = {
            "bm25": ("--config.qa.bm25_weight=0.5",),
            "hybrid": ("--config.qa.hybrid_bm25_weight=0.25", "--config.qa.hybrid_pool=6"),
        }.get(retriever, ())
        r = _cli(root, ddir, work, "evaluate", "--retriever", retriever, "--limit", "16", *weight)
        assert r.returncode == 0, r.stderr[-3000:]
        out = os.path.join(paths.eval_dir(work), f"qa.{retriever}")
        metrics = json.load(open(out + ".metrics.json"))
        preds = [json.loads(line) for line in open(out + ".predictions.jsonl")]
        assert len(preds) == 16 and metrics["questions"] == 16
        assert metrics["exact_match"] == np.mean([p["correct"] for p in preds])
        assert {"question", "prediction", "gold", "correct", "top_blocks"} <= set(preds[0])
        assert len(preds[0]["top_blocks"]) == 3 and "title" in preds[0]["top_blocks"][0]
        assert 0 <= metrics["recall@1"] <= metrics["recall@2"] <= metrics["recall@4"] <= 1
        # each block read carries its own best span: the prediction is the span of the block
        # with the best span score + retrieval score (dense relevance; 0.5 x BM25's score)
        for p in preds:
            top = p["top_blocks"]
            added = [
                {"dense": b["score"], "bm25": 0.5 * b.get("bm25", 0), "hybrid": b.get("hybrid")}[
                    retriever
                ]
                for b in top
            ]
            joint = [b["span_score"] + a for b, a in zip(top, added)]
            chosen = top[int(np.argmax(joint))]
            assert chosen["id"] == p["block"]["id"] and chosen["span"] == p["prediction"], p
            np.testing.assert_allclose(max(joint), p["score"], rtol=1e-5, atol=1e-5)
        if retriever == "hybrid":  # dense relevance + 0.25 x BM25 (its top-k search's scores)
            from realm_jax.index.bm25 import BM25Retriever

            src = datasets.blocks_source(ddir)
            recs = src.__getitems__(range(len(src)))
            lexical = BM25Retriever([f"{r['title'].decode()}\n{r['text'].decode()}" for r in recs])
            for p in preds:
                ids, sc = lexical.search([p["question"]], len(recs))
                bm25 = dict(zip(ids[0].tolist(), sc[0].tolist()))
                top = p["top_blocks"]
                want = [b["score"] + 0.25 * bm25[b["id"]] for b in top]
                np.testing.assert_allclose([b["hybrid"] for b in top], want, rtol=1e-4, atol=1e-4)
                assert want == sorted(want, reverse=True)  # read best first

    # a fine-tuning workdir as another run's warm start (model.init_from_realm): its trained
    # span head comes too only when asked for (a reading phase before ORQA fine-tuning)
    from realm_jax.train import warm_start

    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    mesh = sharding.make_mesh(config(root, ddir).mesh)
    _, target = abstract_params(config(root, ddir), mesh, "reader")
    saved = sharding.to_host(checkpoint.restore_params_subtree(mgr, 60, "reader", target))
    fresh = warm_start.realm_params(work, config(root, ddir))["reader"]
    carried = warm_start.realm_params(
        work, config(root, ddir, "model.init_span_head_from_realm=True")
    )["reader"]
    assert "span" not in fresh and set(carried) == set(saved)
    for a, b in zip(jax.tree.leaves(carried["span"]), jax.tree.leaves(saved["span"])):
        np.testing.assert_array_equal(a, b)
    return root, ddir, work, metrics


def _more_evaluations(root, ddir, work, metrics, tmp_path):
    """BM25 retrieval alone, a predictions file rescored, CuratedTREC's regex answers, `ask`."""
    r = _cli(
        root, ddir, work, "evaluate", "--retriever", "bm25", "--limit", "16", "--retrieval_only"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    alone = json.load(open(os.path.join(paths.eval_dir(work), "qa.bm25-retrieval.metrics.json")))
    assert "exact_match" not in alone and alone["model"] == "no model (retrieval alone)"
    assert {k: v for k, v in alone.items() if k.startswith("recall")} == {
        k: v for k, v in metrics.items() if k.startswith("recall")
    }  # the same BM25 retrieval as under the reader

    # the dense predictions file rescored as ORQA's evaluate_predictions does: the same EM
    dense = os.path.join(paths.eval_dir(work), "qa.dense")
    r = _cli(root, ddir, work, "evaluate", "--predictions", dense + ".predictions.jsonl")
    em = json.load(open(dense + ".metrics.json"))["exact_match"]
    assert r.returncode == 0 and f"accuracy {em:.4f}" in r.stdout, r.stdout + r.stderr[-2000:]

    # CuratedTREC's format: regex answers, scored by regex match, recall by regex search
    qs = [json.loads(line) for line in open(root / "qa.jsonl")]
    (root / "trec.tsv").write_text(
        "".join(
            f"{i}\tfactoid\t{q['question']}\t{re.escape(q['answers'][0])}\n"
            for i, q in enumerate(qs)
        )
    )
    trec = str(tmp_path / "trec")
    r = _cli(root, ddir, work, "evaluate", "--questions", str(root / "trec.tsv"), "--output", trec)
    assert r.returncode == 0, r.stderr[-3000:]
    regex = json.load(open(trec + ".metrics.json"))
    preds = [json.loads(line) for line in open(trec + ".predictions.jsonl")]
    assert regex["questions"] == 16 and regex["exact_match"] == np.mean(
        [p["correct"] for p in preds]
    )
    for p in preds:  # scored by ORQA's regex_match (a match at the start of the prediction)
        assert p["correct"] == (re.match(p["gold"][0], p["prediction"], re.I) is not None)

    r = _cli(root, ddir, work, "ask", "What is materialism?")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("answer: ") and re.search(r"^  \[.*\] block \d+: ", r.stdout, re.M)
    r = _cli(root, ddir, work, "ask", stdin="What is materialism?\nWho was Plato?\n\n")
    assert r.returncode == 0 and r.stdout.count("answer: ") == 2, r.stdout + r.stderr[-2000:]
    _python_api(root, ddir, work)


def test_bad_beams_are_refused_before_any_work(qa_files, tmp_path):
    root, ddir = qa_files
    with pytest.raises(ValueError, match="reader_beam_size"):
        qa_commands.train(config(root, ddir, "qa.reader_beam_size=17"), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="retriever_beam_size = 500 exceeds the corpus"):
        qa_commands.train(config(root, ddir, "qa.retriever_beam_size=500"), str(tmp_path / "b"))
    assert not os.path.exists(paths.checkpoint_dir(str(tmp_path / "a")))


def _python_api(root, ddir, work):
    """realm_jax.load on the fine-tuned workdir: answer() gives the predictions `evaluate`
    wrote for each retriever (the CLI's own files), retrieve() the blocks evaluate read, in
    order; dense scores are a numpy inner product of embed_queries with the index; the
    document embedder (frozen in fine-tuning) re-embeds blocks from their text to the index."""
    import realm_jax
    from realm_jax.data import datasets as ds
    from realm_jax.index import store
    from realm_jax.tokenization import encode_block

    over = [*OVERRIDES, f"data.corpus={root / 'corpus.jsonl'}", f"data.data_dir={ddir}"]
    over += ["qa.bm25_weight=0.5", "qa.hybrid_bm25_weight=0.25", "qa.hybrid_pool=6"]
    model = realm_jax.load(work, config="configs/orqa.py:smoke", overrides=over)
    for retriever in ("dense", "bm25", "hybrid"):
        out = os.path.join(paths.eval_dir(work), f"qa.{retriever}.predictions.jsonl")
        preds = [json.loads(line) for line in open(out)][:5]
        answers = model.answer([p["question"] for p in preds], retriever=retriever)
        for p, a in zip(preds, answers, strict=True):
            assert a.text == p["prediction"] and a.block.block_id == p["block"]["id"], (p, a)
            assert [h.block_id for h in a.evidence] == [b["id"] for b in p["top_blocks"]]
            hits = model.retrieve(p["question"], k=3, retriever=retriever)
            assert [h.block_id for h in hits] == [b["id"] for b in p["top_blocks"]], retriever
    q = ["What is materialism?", "Who was Plato?"]
    _, emb_path = store.latest_valid(paths.index_dir(work))
    emb = np.asarray(store.load_embeddings(emb_path))
    brute = model.embed_queries(q) @ emb.T
    hits = model.retrieve(q, k=4)
    for row, got in zip(brute, hits, strict=True):
        np.testing.assert_allclose([h.score for h in got], np.sort(row)[::-1][:4], rtol=1e-5)
    tokens, _, _ = ds.load_blocks(ddir)
    src = ds.blocks_source(ddir)
    same = [  # blocks whose text re-tokenises to the prepared tokens (whole passages)
        i
        for i in range(len(src))
        if np.array_equal(
            encode_block(src[i]["title"].decode(), src[i]["text"].decode(), tokens.shape[1])[0],
            tokens[i],
        )
    ][:6]
    assert len(same) >= 3
    again = model.embed_blocks(
        [src[i]["text"].decode() for i in same], titles=[src[i]["title"].decode() for i in same]
    )
    np.testing.assert_allclose(again, emb[same], rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="retriever must be one of"):
        model.retrieve("x", retriever="nope")

    # export writes HF's block_records.npy beside the index: row i = block i's text, read back
    # here with the allow-listed reader (never numpy's pickle loader)
    from realm_jax import cli
    from realm_jax.interop.block_records import load_npy_strings

    out = os.path.join(os.path.dirname(work), "hf-export")
    assert cli.main(["export", "--config", "configs/orqa.py:smoke", "--workdir", work,
                     "--out", out, *[f"--config.{o}" for o in over]]) == 0  # fmt: skip
    records = load_npy_strings(os.path.join(out, "openqa", "block_records.npy"))
    assert len(records) == len(src) == emb.shape[0]
    assert [bytes(r) for r in records] == [bytes(src[i]["text"]) for i in range(len(src))]

    # the exported folder loads too (imported into a temporary workdir): the same answers
    exported = realm_jax.load(out, config="configs/orqa.py:smoke", overrides=over)
    for a, b in zip(exported.answer(q), model.answer(q), strict=True):
        assert a.text == b.text and [h.block_id for h in a.evidence] == [
            h.block_id for h in b.evidence
        ]

    # docs/python.md's examples, run as written on this workdir (its config recorded as the
    # CLI records it, so load() needs no config argument)
    from realm_jax import api

    api.record_run_config(work, "configs/orqa.py:smoke", over)
    with open(os.path.join(REPO, "docs", "python.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 4
    namespace = {}
    for code in blocks:
        exec(
            compile(code.replace('"runs/smoke-qa"', repr(work)), "docs/python.md", "exec"),
            namespace,
        )
    assert namespace["a"].evidence and namespace["q"].shape == (2, namespace["b"].shape[1])
    # its update example: the note added was retrieved, then deleted, never retrieved again
    m, note = namespace["model"], namespace["note"]
    assert namespace["hit"].text == note["text"] and m.corpus_version == 2
    again = m.retrieve("When did the Ming dynasty end?", k=5, retriever="bm25")
    assert note["text"] not in [h.text for h in again]
