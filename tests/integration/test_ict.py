"""ICT: the loss against numpy with negatives from every device, the example builder, the
held-out corpus cut, and the warm start of REALM's embedders from an ICT run."""

import copy
import functools
import os

import jax
import numpy as np
import pytest

from realm_jax import sharding
from realm_jax import tokenization as tk
from realm_jax import workdir as paths
from realm_jax.config import load_config
from realm_jax.data import ict as ict_data
from realm_jax.ict import commands as ict_commands
from realm_jax.ict import step as ict_step
from realm_jax.train import warm_start
from tests.conftest import REPO
from tests.support.realm_fixtures import tiny_networks

ARCH = tiny_networks("embedder", "reader", max_positions=64)
# The smoke config's vocabulary: bert-base-uncased's 30,522 wordpieces, which the prepared sample's
# token ids come from (a smaller model.vocab_size is refused: datasets.check_vocab)
TINY = ARCH + [
    "model.proj_dropout=0.0",
    "data.block_len=24",
    "data.query_len=12",
    "train.batch_size=16",
]


def _config(*extra):
    return load_config(os.path.join(REPO, "configs", "ict.py:smoke"), TINY + list(extra))


def _sample_config(*extra):
    """The bundled sample's passages, blocks of 64 and sentences of 32 wordpieces."""
    sample = os.path.join(REPO, "data", "sample", "corpus.jsonl")
    return _config(
        f"data.corpus={sample}",
        "data.block_len=64",
        "data.query_len=32",
        "data.masking=random",
        "model.embedder.max_position_embeddings=64",
        *extra,
    )


def _numpy_ict(q, b):
    """Softmax cross-entropy of q [B, D] against all blocks b [B, D], label = own index."""
    logits = q.astype(np.float64) @ b.astype(np.float64).T
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    loss = (lse - np.diag(logits)).mean()
    return loss, (logits.argmax(1) == np.arange(len(q))).mean()


def test_ict_loss_matches_numpy_with_negatives_from_all_devices():
    config = _config()
    mesh = sharding.make_mesh(config.mesh)
    assert mesh.devices.size >= 4  # 4 queries a device or fewer: negatives must cross devices
    model, _, state, _ = ict_step.create_state(config, mesh, jax.random.key(0))
    rng = np.random.default_rng(0)
    q = np.zeros((16, 12), np.int32)
    b = np.zeros((16, 24), np.int32)
    for i in range(16):
        q[i, :6] = [101, *rng.integers(200, 500, 4), 102]
        b[i, :10] = [101, 300, 102, *rng.integers(200, 500, 6), 102]
    batch = sharding.global_batch({"query_ids": q, "block_ids": b}, mesh)
    fn = jax.jit(functools.partial(ict_step.ict_loss, model=model, mesh=mesh))
    loss, metrics = fn(state.params, batch)
    params = jax.device_get(state.params)
    q_emb = np.asarray(
        model.apply({"params": params}, q, np.zeros_like(q), (q != 0) * 1, method="embed_query")
    )
    b_emb = np.asarray(
        model.apply(
            {"params": params},
            b,
            ((np.cumsum(b == 102, 1) - (b == 102) >= 1) & (b != 0)).astype(np.int32),
            (b != 0) * 1,
            method="embed_doc",
        )
    )
    want_loss, want_acc = _numpy_ict(q_emb, b_emb)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), want_acc)
    # with each device's own 2 blocks as the only negatives the loss would differ
    local = np.mean([_numpy_ict(q_emb[i : i + 2], b_emb[i : i + 2])[0] for i in range(0, 16, 2)])
    assert abs(local - want_loss) > 0.1


def test_ict_pair_removes_the_query_sentence():
    # [CLS] t [SEP] s0 s0 | s1 s1 s1 | s2 [SEP]; sentence starts at 3, 5, 8
    rec = {
        "token_ids": np.array([101, 7, 102, 10, 11, 20, 21, 22, 30, 102], np.int32),
        "sentence_starts": np.array([3, 5, 8], np.int32),
    }
    seen = set()
    for seed in range(40):
        ex = ict_data.ict_pair(rec, np.random.default_rng(seed), 8, 12, mask_rate=1.0)
        q = ex["query_ids"][ex["query_ids"] != 0].tolist()
        blk = ex["block_ids"][ex["block_ids"] != 0].tolist()
        body = q[1:-1]
        assert q[0] == tk.CLS_ID and q[-1] == tk.SEP_ID
        assert body in ([10, 11], [20, 21, 22], [30])
        full = rec["token_ids"].tolist()
        at = full.index(body[0])
        assert blk == full[:at] + full[at + len(body) :]  # the sentence is gone, the rest kept
        seen.add(tuple(body))
    assert len(seen) == 3
    ex = ict_data.ict_pair(rec, np.random.default_rng(0), 8, 12, mask_rate=0.0)
    assert ex["block_ids"][:10].tolist() == rec["token_ids"].tolist()  # unmasked: whole block


def test_cut_out_removes_each_held_out_sentence_from_its_block():
    tokens = np.array([[101, 7, 102, 10, 11, 20, 21, 102], [101, 8, 102, 30, 31, 102, 0, 0]])
    queries = np.array([[101, 20, 21, 102, 0], [101, 99, 102, 0, 0]])
    texts = ["T\nab cd.", "U\nef."]
    got, got_texts, cut = ict_data.cut_out(tokens, texts, np.array([0, 1]), queries, ["cd.", "zz"])
    assert cut == 1
    np.testing.assert_array_equal(got[0], [101, 7, 102, 10, 11, 102, 0, 0])
    np.testing.assert_array_equal(got[1], tokens[1])  # sentence not found: unchanged
    assert got_texts == ["T\nab  ", "U\nef."]


def test_ict_run_evaluates_and_warm_starts_realm_embedders(tmp_path):
    """`ict` trains on the sample (held-out recall logged next to BM25's), and REALM's
    model.init_embedders_from_ict loads exactly the ICT checkpoint's embedders."""
    from realm_jax import checkpoint
    from realm_jax.data import prepare
    from realm_jax.pretrain import step as pretrain_step

    work = str(tmp_path / "ict")
    config = _sample_config(
        "train.steps=4",
        "train.eval_every=4",
        "train.checkpoint_every=4",
        "train.log_every=2",
        "train.eval_examples=64",
    )
    prepare.prepare(config, paths.data_dir(config, work))
    history = ict_commands.train(config, work)
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses and np.isfinite(losses).all(), losses  # the sample's ids all embedded
    evals = [h for h in history if "eval/recall@5" in h]
    assert [h["step"] for h in evals] == [0, 4]
    assert 0 <= evals[-1]["eval/recall@5"] <= 1 and "eval/bm25_recall@5" in evals[-1]
    assert evals[-1]["eval/bm25_recall@20"] >= evals[-1]["eval/bm25_recall@5"]

    # A stop request (SIGTERM/SIGINT) seen on a step that is also a checkpoint step: that step
    # is saved once and the run ends cleanly (a second, forced save of the same step raised
    # orbax's StepAlreadyExistsError).
    import threading

    from realm_jax import checkpoint as ckpt

    stop = threading.Event()
    stop.set()
    more = copy.deepcopy(config)
    more.unlock()
    more.train.steps, more.train.checkpoint_every, more.train.eval_every = 8, 1, 0
    ict_commands.train(more, work, stop_event=stop)
    assert ckpt.manager(work, with_data=False, read_only=True).latest_step() == 5

    realm = load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"),
        [a for a in TINY if not a.startswith("train.")]
        + ["data.block_len=64", "data.query_len=32", f"model.init_embedders_from_ict={work}"]
        + ["model.reader.max_position_embeddings=128"],
    )
    mesh = sharding.make_mesh(realm.mesh)
    _, _, state, _ = pretrain_step.create_state(
        realm, mesh, jax.random.key(1), warm_start.params_hook(realm)
    )
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    ecfg = __import__("realm_jax.model.bert", fromlist=["x"]).ModelConfig.from_config(
        realm.model, "embedder"
    )
    want = warm_start.restore_embedders(mgr, mgr.latest_step(), ecfg)  # step 5: the latest
    for name in ("query_embedder", "doc_embedder"):
        got = jax.device_get(state.params[name])
        jax.tree.map(np.testing.assert_array_equal, got, want[name])


def test_ict_command_refuses_a_realm_config(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "realm_jax", "ict", "--workdir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "configs/ict.py" in out.stderr


@pytest.mark.parametrize("variant", ["smoke", "small", "base", "squad"])
def test_ict_configs_load(variant):
    c = load_config(os.path.join(REPO, "configs", f"ict.py:{variant}"))
    assert c.task == "ict" and 0 < c.ict.mask_rate < 1


def test_held_out_recall_matches_a_numpy_brute_force(tmp_path):
    """IctEvaluator's recall@k against numpy: each held-out sentence's wordpieces cut out of
    its own block here (the first contiguous run), every query and block embedded, float64
    scores over the whole corpus, the own block's rank counted."""
    from realm_jax.data import datasets, prepare
    from realm_jax.ict.evaluation import IctEvaluator
    from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens

    config = _sample_config(
        "train.eval_examples=96",
        "ict.bm25_baseline=false",
        "ict.recall_ks=(1, 10, 300, 1000)",  # an untrained retriever's ranks, spread out
    )
    ddir = str(tmp_path / "data")
    prepare.prepare(config, ddir)
    mesh = sharding.make_mesh(config.mesh)
    model, _, state, _ = ict_step.create_state(config, mesh, jax.random.key(3))
    tokens, _, _ = datasets.load_blocks(ddir)
    got = IctEvaluator(config, mesh, model, ddir, tokens)(state, 0)

    src = datasets.examples_source(ddir, "eval")
    recs = [src[i] for i in range(min(96, len(src)))]
    table = tokens.copy()
    queries, own = [], []
    for r in recs:
        q = np.asarray(r["token_ids"][: config.data.query_len], np.int32)
        body, b = q[1:-1], int(r["block_id"])
        row = table[b]
        for at in range(len(row) - len(body) + 1):
            if np.array_equal(row[at : at + len(body)], body):
                table[b] = tk.pad_to(np.concatenate([row[:at], row[at + len(body) :]]), len(row))
                break
        queries.append(tk.pad_to(q, config.data.query_len))
        own.append(b)
    params = jax.device_get(state.params)
    q = np.asarray(embed_query_tokens(model, params, np.stack(queries)), np.float64)
    d = np.asarray(embed_block_tokens(model, params, table), np.float64)
    scores = q @ d.T  # [Q, N]
    rank = (scores > scores[np.arange(len(own)), own][:, None]).sum(1)  # 0 = first
    assert got["examples"] == len(recs)
    for k in config.ict.recall_ks:
        assert got[f"recall@{k}"] == pytest.approx((rank < k).mean(), abs=1e-9), k
    assert np.isfinite(scores).all() and 0 < got["recall@300"] < got["recall@1000"] < 1
