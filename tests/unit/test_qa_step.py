"""ORQA fine-tuning pieces against independent references: answer containment and gold spans
(pure-Python loops), the reader input (the host tokenizer's joint_ids and ORQA's
reader_inputs rules), the loss (numpy), and answer text cut from the original block."""

import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import tokenization as tk
from realm_jax.model.realm import span_candidates
from realm_jax.qa import losses, step
from realm_jax.qa.evaluation import span_text


def _python_starts(seq, answer):
    """Positions where `answer` (a list, no padding) occurs in `seq`."""
    n = len(answer)
    return [p for p in range(len(seq) - n + 1) if n and list(seq[p : p + n]) == list(answer)]


def _random_case(seed, B=3, K=5, L=24, A=3, La=4):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(200, 206, size=(B, K, L)).astype(np.int32)  # small alphabet: repeats
    tokens[:, :, -3:] = 0  # padding at the end
    answers = np.zeros((B, A, La), np.int32)
    for b in range(B):
        for a in range(A):
            n = int(rng.integers(0, La + 1))  # 0 = no answer in this row
            answers[b, a, :n] = rng.integers(200, 206, size=n)
    answers[0, 0] = [tokens[0, 2, L - 5], tokens[0, 2, L - 4], 0, 0]  # ends just before padding
    return tokens, answers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answer_starts_matches_a_python_search(seed):
    tokens, answers = _random_case(seed)
    got = np.asarray(step.answer_starts(jnp.asarray(tokens), jnp.asarray(answers)))
    B, K, L = tokens.shape
    want = np.zeros((B, K, answers.shape[1], L), bool)
    for b in range(B):
        for k in range(K):
            for a, row in enumerate(answers[b]):
                for p in _python_starts(tokens[b, k], [int(t) for t in row if t]):
                    want[b, k, a, p] = True
    np.testing.assert_array_equal(got, want)
    assert want.any() and not want.all()
    contains = np.asarray(step.contains_answer(jnp.asarray(tokens), jnp.asarray(answers)))
    np.testing.assert_array_equal(contains, want.any(axis=(2, 3)))


def test_answer_at_the_very_end_matches_and_a_cut_answer_does_not():
    tokens = np.array([[[101, 7, 8, 9, 102]]], np.int32)
    answers = np.array([[[9, 102, 0], [9, 102, 55], [0, 0, 0]]], np.int32)
    got = np.asarray(step.answer_starts(jnp.asarray(tokens), jnp.asarray(answers)))[0, 0]
    assert got[0].tolist() == [False, False, False, True, False]
    assert not got[1].any() and not got[2].any()  # runs past the end; the empty row


def test_reader_input_follows_orqa_reader_inputs():
    q = [101, 11, 12, 102]
    block = [101, 21, 102, 31, 32, 33, 34, 102]
    qa = np.zeros((1, 6), np.int32)
    qa[0, : len(q)] = q
    blocks = np.zeros((1, 1, 10), np.int32)
    blocks[0, 0, : len(block)] = block
    for length in (14, 9):  # room to spare; a block cut by the reader length
        ids, segs, mask, bmask = (
            np.asarray(x)[0, 0] for x in step.reader_input(qa, blocks, length)
        )
        want_ids, want_segs = tk.joint_ids([11, 12], [21], [31, 32, 33, 34], length)
        n = len(want_ids)
        assert ids[:n].tolist() == want_ids and not ids[n:].any()
        assert segs[:n].tolist() == want_segs and mask.tolist() == [1] * n + [0] * (length - n)
        assert ids[n - 1] == tk.SEP_ID  # ORQA: the last token of a cut block is [SEP]
        # spans may lie on the title and body wordpieces, never on [SEP] or the question
        want_mask = [s == 1 and t != tk.SEP_ID for t, s in zip(want_ids, want_segs)]
        assert bmask[:n].tolist() == want_mask and not bmask[n:].any()


def test_span_correct_matches_a_python_reference():
    rng = np.random.default_rng(3)
    B, R, L, W = 2, 3, 20, 4
    ids = rng.integers(200, 204, size=(B, R, L)).astype(np.int32)
    ids[:, :, 0], ids[:, :, 5], ids[:, :, -1] = 101, 102, 102
    bmask = np.zeros((B, R, L), bool)
    bmask[:, :, 6:-1] = True  # the question (positions 1-4) matches too, but is not the block
    answers = np.array([[[200, 201, 0], [203, 0, 0]], [[202, 202, 202], [0, 0, 0]]], np.int32)
    starts, ends = span_candidates(L, W)
    got = np.asarray(step.span_correct(ids, bmask, jnp.asarray(answers), starts, ends))
    want = np.zeros((B, R, len(starts)), bool)
    for b in range(B):
        for r in range(R):
            for s, (i, j) in enumerate(zip(starts, ends)):
                inside = bmask[b, r, i] and bmask[b, r, j]
                span = ids[b, r, i : j + 1].tolist()
                want[b, r, s] = inside and any(
                    span == [int(t) for t in row if t] for row in answers[b]
                )
    np.testing.assert_array_equal(got, want)
    assert want.any()


def _np_marginal(logits, correct):
    if not correct.any():
        return 0.0
    m = logits.max()
    den = m + np.log(np.exp(logits - m).sum())
    num = m + np.log(np.exp(logits[correct] - m).sum())
    return den - num


def test_orqa_loss_matches_numpy():
    rng = np.random.default_rng(4)
    k, R, S = 6, 3, 5
    r_logits = rng.normal(size=(2, k)).astype(np.float32)
    r_correct = np.array([[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    span = rng.normal(size=(2, R, S)).astype(np.float32)
    s_correct = np.zeros((2, R, S), bool)
    s_correct[0, 1, 2] = s_correct[0, 2, 4] = True
    total, retr, read = losses.orqa_loss(r_logits, r_correct, span, s_correct, r_logits[:, :R])
    for b in range(2):
        want_retr = _np_marginal(r_logits[b], r_correct[b])
        joint = (span[b] + r_logits[b, :R, None]).reshape(-1)
        want_read = _np_marginal(joint, s_correct[b].reshape(-1))
        np.testing.assert_allclose(float(retr[b]), want_retr, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(read[b]), want_read, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(total[b]), want_retr + want_read, rtol=1e-5, atol=1e-6)
    assert float(total[1]) == 0.0  # nothing correct: no loss (ORQA)


def test_span_text_cuts_the_original_text():
    title, text = "2008 Sichuan earthquake", "It killed 69,197 people in the U.S.-style town."
    ids, _ = tk.encode_block(title, text, 40)
    tokens = [int(t) for t in ids]
    body = tk.wordpieces([text])[0]
    sep = tokens.index(tk.SEP_ID)
    a = body.tokens.index("69") + sep + 1
    assert span_text(title, text, tokens, a, a + 2) == "69,197"
    assert span_text(title, text, tokens, 1, 1) == "2008"
    assert span_text(title, text, tokens, 2, sep + 1) == tk.decode(tokens[2 : sep + 2])  # across
    assert span_text(title, text, tokens, 0, 0) == ""  # [CLS]: no span


def test_finetuning_starts_from_huggingface_realm_folders(shared):
    """REALM's released ORQA checkpoints are RealmEmbedder + RealmReader folders: the span
    head comes with the reader, and the state's reader reproduces HF's span scores."""
    import jax

    from realm_jax import sharding
    from realm_jax.config import load_config
    from realm_jax.model.realm import Reader
    from realm_jax.train.warm_start import params_hook

    ref = shared("reference", "tiny_realm")
    arch = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    over = [f"model.{net}.{k}={v}" for net in ("embedder", "reader") for k, v in arch.items()]
    over += [f"model.{net}.max_position_embeddings=512" for net in ("embedder", "reader")]
    cfg = load_config(
        "configs/orqa.py:smoke",
        over
        + [
            "model.span_hidden_size=32",
            "model.max_span_width=5",
            f"model.init_embedder_from={ref}/embedder",
            f"model.init_reader_from={ref}/reader",
            "mesh.shape=(1,1)",
        ],
    )
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    hook = params_hook(cfg, span_head=True)
    model, _, state, _ = step.create_state(cfg, mesh, jax.random.key(0), hook)
    r = np.load(f"{ref}/reference.npz")
    logits, _, _ = Reader(model.cfg).apply(
        {"params": state.params["reader"]},
        *(jnp.asarray(r[k]) for k in ("reader_ids", "reader_type_ids", "reader_mask")),
        jnp.asarray(r["reader_block_mask"]),
        method=Reader.span_logits,
    )
    valid = r["reader_span_logits"] > -1e30
    np.testing.assert_allclose(np.asarray(logits)[valid], r["reader_span_logits"][valid], atol=1e-4)
    q = np.asarray(
        step.embed_query_tokens(model, state.params, jnp.asarray(r["query_ids"] * r["query_mask"]))
    )
    np.testing.assert_allclose(q, r["query_projected"], rtol=1e-5, atol=1e-4)
