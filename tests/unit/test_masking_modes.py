"""data.mask_mode, REALM's Table 2 masking ablations: salient spans (unchanged), SpanBERT's
random whole-word spans and BERT's random uniform 15%, as pure functions and through the
input pipeline."""

import os

import numpy as np
import pytest

from realm_jax import tokenization as tk
from realm_jax.config import CHOICES, ConfigError, load_config, validate
from realm_jax.data import datasets
from realm_jax.data import masking as M
from realm_jax.data import pipeline as PL
from realm_jax.data import prepare as P
from tests.conftest import REPO

SAMPLE = os.path.join(REPO, "data", "sample", "corpus.jsonl")
SPEC = os.path.join(REPO, "configs", "realm.py:smoke")
EIFFEL = "The Eiffel Tower was completed in 1889 in Paris by Gustave Eiffel."
SENTENCES = (
    EIFFEL,
    "Antidisestablishmentarianism puzzled the unsuspecting lexicographers of Saskatchewan.",
    "Marie Curie, born Maria Skłodowska in Warsaw, won Nobel Prizes in 1903 and 1911 for her "
    "pioneering research on radioactivity, polonium and radium, and she remains the only "
    "person honoured in two scientific fields.",
)
L = 64  # query_len
SPECIAL = (tk.PAD_ID, tk.CLS_ID, tk.SEP_ID)


def _query(text: str, query_len: int = L) -> np.ndarray:
    return tk.encode_query(text, query_len)


def _record(text: str, spans=((2, 4),)) -> dict:
    ids = tk.query_ids(tk.wordpieces([text])[0].ids, L)
    return {
        "token_ids": np.asarray(ids, np.int32),
        "span_starts": np.asarray([a for a, _ in spans], np.int32),
        "span_ends": np.asarray([b for _, b in spans], np.int32),
        "block_id": 7,
    }


def _n_maskable(q) -> int:
    return int((~np.isin(q, SPECIAL)).sum())


def _budget(n: int, max_predictions: int) -> int:
    return min(max(1, round(0.15 * n)), max_predictions)


def _masked(out: dict) -> tuple[np.ndarray, np.ndarray]:
    k = int(out["mlm_weights"].sum())
    return out["mlm_positions"][:k], out["mlm_targets"][:k]


def _check_masked(original: np.ndarray, out: dict, max_predictions: int) -> np.ndarray:
    """The rules every mode keeps: fixed shapes, sorted distinct non-special positions, the
    original ids as targets, [MASK] exactly there and the rest unchanged. The positions."""
    for key in ("mlm_positions", "mlm_targets", "mlm_weights"):
        assert out[key].shape == (max_predictions,)
    w = out["mlm_weights"]
    k = int(w.sum())
    assert 1 <= k <= max_predictions and (w[:k] == 1).all() and (w[k:] == 0).all()
    pos, tgt = _masked(out)
    assert (np.diff(pos) > 0).all()  # sorted, distinct
    assert not np.isin(original[pos], SPECIAL).any()
    assert (tgt == original[pos]).all()
    assert (out["mlm_positions"][k:] == 0).all() and (out["mlm_targets"][k:] == 0).all()
    q = out["query_ids"]
    assert (q[pos] == tk.MASK_ID).all()
    keep = np.ones(len(q), bool)
    keep[pos] = False
    assert (q[keep] == original[keep]).all()
    return pos


def _check_whole_words(q: np.ndarray, pos: np.ndarray) -> None:
    """Every word is masked entirely or not at all."""
    chosen = set(pos.tolist())
    for a, b in M.words(q):
        hit = [p in chosen for p in range(a, b + 1)]
        assert all(hit) or not any(hit), f"word {a}..{b} partly masked: {sorted(chosen)}"


# ---------------------------------------------------------------------------- word boundaries
def test_words_follow_the_hash_pieces():
    q = _query(EIFFEL)
    assert tk.load_tokenizer().id_to_token(int(q[3])) == "##iff"
    cont = M.is_continuation()
    assert cont.shape == (tk.load_tokenizer().get_vocab_size(),) and cont[q[3]] and not cont[q[2]]
    assert M.is_continuation() is cont  # cached
    ws = M.words(q)
    assert ws[0] == (1, 1) and ws[1] == (2, 4) and (14, 16) in ws  # "the", "e ##iff ##el"
    assert ws[-1] == (17, 17)  # "." (the [SEP] at 18 and padding are in no word)
    assert sum(b - a + 1 for a, b in ws) == _n_maskable(q) == 17


# ------------------------------------------------------------------------------------ uniform
@pytest.mark.parametrize("text", SENTENCES)
def test_uniform_masks_round_15_percent_of_the_wordpieces(text):
    q = _query(text)
    n = _n_maskable(q)
    for seed in range(20):
        out = PL.mask_record(_record(text), np.random.default_rng(seed), "uniform", L, 10)
        pos = _check_masked(q, out, 10)
        assert len(pos) == _budget(n, 10) == max(1, round(0.15 * n))


def test_uniform_never_exceeds_max_predictions():
    q = _query(SENTENCES[2])
    assert round(0.15 * _n_maskable(q)) > 3
    for seed in range(10):
        pos = M.uniform_positions(q, np.random.default_rng(seed), 3)
        assert len(pos) == 3 and not np.isin(q[pos], SPECIAL).any()


def test_uniform_chooses_every_position_about_equally():
    q = _query(EIFFEL)
    rng, counts, draws = np.random.default_rng(0), np.zeros(L), 4000
    for _ in range(draws):
        counts[M.uniform_positions(q, rng, 10)] += 1
    body = ~np.isin(q, SPECIAL)
    expect = draws * _budget(17, 10) / 17  # 3 of 17 a draw: about 706 each
    assert (counts[~body] == 0).all()
    assert np.abs(counts[body] / expect - 1).max() < 0.15, counts[body]


# -------------------------------------------------------------------------------- random span
@pytest.mark.parametrize("max_predictions", [10, 4, 2])
@pytest.mark.parametrize("text", SENTENCES)
def test_random_span_masks_whole_words_within_the_budget(text, max_predictions):
    q = _query(text)
    n = _n_maskable(q)
    budget = _budget(n, max_predictions)
    longest = max(b - a + 1 for a, b in M.words(q))
    fits = [b - a + 1 for a, b in M.words(q) if b - a + 1 <= max_predictions]
    for seed in range(50):
        out = PL.mask_record(
            _record(text), np.random.default_rng(seed), "random_span", L, max_predictions
        )
        pos = _check_masked(q, out, max_predictions)
        _check_whole_words(q, pos)
        assert len(pos) <= max_predictions
        # the budget is reached, passed by less than the last (whole) word, unless no word fits
        assert len(pos) <= budget - 1 + longest
        if sum(fits) >= budget:
            assert len(pos) >= budget or len(pos) + min(fits) > max_predictions
        # contiguous runs of whole words: every run starts and ends at a word boundary
        starts = {a for a, _ in M.words(q)}
        ends = {b for _, b in M.words(q)}
        runs = np.split(pos, np.flatnonzero(np.diff(pos) > 1) + 1)
        assert all(r[0] in starts and r[-1] in ends for r in runs)


def test_random_span_keeps_whole_words_that_do_not_fit_out():
    """max_predictions 2: the 3-piece "e ##iff ##el" never fits, so it is never masked."""
    q = _query(EIFFEL)
    for seed in range(100):
        pos = M.random_span_positions(q, np.random.default_rng(seed), 2)
        assert 1 <= len(pos) <= 2 and not set(pos.tolist()) & {2, 3, 4, 14, 15, 16}


def test_random_span_draws_long_spans_on_a_long_sentence():
    """Spans are several words (SpanBERT's Geo(0.2) truncated at 10: mean 3.8 words)."""
    p = M.span_lengths()
    assert p.shape == (10,) and np.isclose(p.sum(), 1) and p[0] > p[-1]
    assert abs((p * np.arange(1, 11)).sum() - 3.8) < 0.01
    q = _query(" ".join(["alpha beta gamma delta epsilon"] * 12), query_len=96)
    n = _n_maskable(q)
    assert n == 60 and _budget(n, 20) == 9
    longest = 0
    for seed in range(200):
        pos = M.random_span_positions(q, np.random.default_rng(seed), 20)
        assert len(pos) == 9  # one-piece words: exactly the budget
        runs = np.split(pos, np.flatnonzero(np.diff(pos) > 1) + 1)
        longest = max(longest, max(len(r) for r in runs))
    assert longest >= 5


def test_empty_sentence_masks_nothing():
    q = tk.pad_to([tk.CLS_ID, tk.SEP_ID], L)
    for fn in (M.uniform_positions, M.random_span_positions):
        assert len(fn(q, np.random.default_rng(0), 10)) == 0


# ------------------------------------------------------------------------------------ salient
def _mask_example_before(rec, span, query_len, max_predictions):
    """pipeline.mask_example as it was before data.mask_mode (the reference for salient)."""
    q = tk.pad_to(rec["token_ids"], query_len)
    a, b = int(rec["span_starts"][span]), int(rec["span_ends"][span])
    b = min(b, a + max_predictions - 1, query_len - 1)
    n = b - a + 1
    positions = np.zeros((max_predictions,), np.int32)
    targets = np.zeros((max_predictions,), np.int32)
    weights = np.zeros((max_predictions,), np.float32)
    positions[:n] = np.arange(a, b + 1)
    targets[:n] = q[a : b + 1]
    weights[:n] = 1.0
    q[a : b + 1] = tk.MASK_ID
    return {
        "query_ids": q,
        "mlm_positions": positions,
        "mlm_targets": targets,
        "mlm_weights": weights,
        "block_id": np.int32(rec["block_id"]),
    }


def _identical(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_salient_is_unchanged():
    rec = _record(EIFFEL, spans=((2, 4), (9, 9), (11, 11), (13, 16), (1, 15)))
    for span in range(5):
        for m in (10, 3):
            _identical(PL.mask_example(rec, span, L, m), _mask_example_before(rec, span, L, m))
    before = {**rec, "example_id": 3}
    for seed in range(20):  # MaskSpan's draw: one span from the grain rng, as before
        span = int(np.random.default_rng(seed).integers(5))
        want = {**_mask_example_before(rec, span, L, 10), "example_id": np.int64(3)}
        for t in (PL.MaskSpan(L, 10), PL.MaskSpan(L, 10, "salient")):
            _identical(t.random_map(before, np.random.default_rng(seed)), want)


# ------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("mode", M.MASK_MODES)
def test_draws_are_a_function_of_the_rng_seed(mode):
    rec = _record(SENTENCES[2], spans=((1, 2), (5, 7), (10, 10)))

    def draw(seed):
        return PL.mask_record(rec, np.random.default_rng(seed), mode, L, 10)

    for seed in range(5):
        _identical(draw(seed), draw(seed))
    seen = {tuple(_masked(draw(seed))[0].tolist()) for seed in range(50)}
    assert len(seen) > 1


# ------------------------------------------------------------------------------ bad mask_mode
def test_unknown_mask_mode_is_refused_early():
    assert CHOICES["data.mask_mode"] == M.MASK_MODES
    cfg = load_config(SPEC, ["data.mask_mode=spanbert"])
    with pytest.raises(
        ConfigError, match="data.mask_mode='spanbert'.*salient, random_span, uniform"
    ):
        validate(cfg)
    validate(load_config(SPEC, ["data.mask_mode=uniform"]))
    with pytest.raises(ValueError, match="data.mask_mode must be one of salient, random_span"):
        PL.MaskSpan(L, 10, "bert")
    with pytest.raises(ValueError, match="data.mask_mode"):
        PL.train_loader(cfg, "/nonexistent", global_batch_size=8, seed=0)


# ----------------------------------------------------------------------- through the pipeline
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("masks")
    tiny = root / "tiny.jsonl"
    with open(SAMPLE) as f, open(tiny, "w") as g:
        g.writelines(line for _, line in zip(range(12), f, strict=False))
    overrides = [f"data.corpus={tiny}", "data.masking=random"]
    overrides += ["data.eval_split_key=doc_id", "data.eval_fraction=0.3"]  # a few held out
    P.prepare(load_config(SPEC, overrides), str(root / "data"))
    return str(root / "data"), overrides


def _originals(data_dir: str, split: str, query_len: int) -> dict[int, np.ndarray]:
    src = datasets.examples_source(data_dir, split)
    return {int(r["example_id"]): tk.pad_to(r["token_ids"], query_len) for r in src}


@pytest.mark.parametrize("mode", ["uniform", "random_span"])
def test_loader_batches_follow_the_mask_mode(prepared, mode):
    d, ov = prepared
    cfg = load_config(SPEC, [*ov, f"data.mask_mode={mode}"])
    Lq, m = cfg.data.query_len, cfg.data.max_predictions
    originals = _originals(d, "train", Lq)
    it = iter(PL.train_loader(cfg, d, global_batch_size=8, seed=0))
    batches = [next(it) for _ in range(3)]
    again = iter(PL.train_loader(cfg, d, global_batch_size=8, seed=0))
    for b in batches:
        _identical(b, next(again))  # deterministic in the seed
        for i, eid in enumerate(b["example_id"]):
            q = originals[int(eid)]
            row = {k: v[i] for k, v in b.items()}
            pos = _check_masked(q, row, m)
            if mode == "uniform":
                assert len(pos) == _budget(_n_maskable(q), m)
            else:
                _check_whole_words(q, pos)


def test_eval_batches_use_the_runs_mask_mode(prepared):
    d, ov = prepared
    cfg = load_config(SPEC, [*ov, "data.mask_mode=uniform"])
    m = cfg.data.max_predictions
    originals = _originals(d, "eval", cfg.data.query_len)
    src = datasets.examples_source(d, "eval")
    batches = PL.eval_batches(cfg, d, batch_size=4, max_examples=0)
    assert batches
    for j, b in enumerate(PL.eval_batches(cfg, d, batch_size=4, max_examples=0)):
        _identical(b, batches[j])  # the same masks at every evaluation
    for j, b in enumerate(batches):
        for i in range(4):
            rec = src[j * 4 + i]
            q = originals[int(rec["example_id"])]
            row = {k: v[i] for k, v in b.items()}
            pos = _check_masked(q, row, m)
            assert len(pos) == _budget(_n_maskable(q), m)
            want = M.uniform_positions(q, np.random.default_rng(int(rec["example_id"])), m)
            assert np.array_equal(pos, want)  # drawn from the example id
    # data.eval_mask_mode: the salient masks of a salient run's evaluation, whatever the
    # training masks
    salient = load_config(SPEC, [*ov, "data.mask_mode=salient"])
    mixed = load_config(SPEC, [*ov, "data.mask_mode=uniform", "data.eval_mask_mode=salient"])
    want = PL.eval_batches(salient, d, batch_size=4, max_examples=0)
    for a, b in zip(want, PL.eval_batches(mixed, d, batch_size=4, max_examples=0), strict=True):
        _identical(a, b)
    bad = load_config(SPEC, [*ov, "data.eval_mask_mode=spanbert"])
    with pytest.raises(ConfigError, match="data.eval_mask_mode='spanbert'"):
        validate(bad)
