"""Write tests/fixtures/release/reference/outputs.npz (+ outputs.json): what transformers' REALM
computes from the release-format TF checkpoints of tests/fixtures/release/ (written by
bench/make_release_fixtures.py), each loaded by transformers' own `load_tf_weights_in_realm`
(which reads them through TensorFlow), on fixed seeded inputs. tests/test_release_outputs.py
imports the same checkpoints with realm-jax (no TensorFlow, no torch) and compares.

    python3.11 -m venv .venv-tfpeer
    .venv-tfpeer/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    .venv-tfpeer/bin/pip install transformers==4.57.6 tensorflow-cpu
    .venv-tfpeer/bin/python bench/make_release_outputs.py [--fixtures tests/fixtures/release]

Never imports realm_jax. Every network is transformers.models.deprecated.realm's, built from a
RealmConfig of the fixtures' sizes (hidden 16, 2 layers, 2 heads, intermediate 36, 100 ids, 24
positions, 2 token types, projection 12, span hidden 6, spans up to 10 wordpieces; "gelu_new",
as RealmConfig's default and the release's BERT), in eval mode, in float32:

  embedder/variables/variables -> RealmEmbedder: projected embeddings of `emb_*` inputs; and
      RealmScorer (the same module as its query and candidate embedder): the relevance scores
      of `scorer_query_*` against `scorer_cand_*` (3 candidates per query)
  bert/variables/variables     -> RealmKnowledgeAugEncoder: MLM logits of `mlm_*` inputs
      (its decoder is tied to the word embeddings, as transformers ties it)
  orqa/.../model.ckpt-300      -> RealmForOpenQA: its query embedder on `qa_query_*` (the
      question form realm-jax's `ask` feeds: token type 0, mask = ids != 0); and
      embedder/encoded/encoded.ckpt (block_emb) loaded into the same model by the same
      function: retrieval scores query . block_emb (RealmForOpenQA.forward's einsum) and the
      top 4 blocks (torch.topk); its reader (RealmReader) on `reader_*` joint inputs of the
      first question's top 4 blocks: its BERT's last hidden states (the span head's input:
      far more sensitive to the attention weights than the span logits, which the fixtures'
      large random weights saturate), the span head's logits per candidate span (what
      RealmReader.forward adds the retrieval scores to before its argmax; the forward returns
      no logits), and RealmReader.forward's own outputs given those retrieval scores and
      gold spans: losses, best block, candidate, start and end.

What load_tf_weights_in_realm cannot load as it stands:
  bert/ (cc_news_pretrained/bert's layout: BERT's pre-training heads, including the
  next-sentence head cls/seq_relationship/{output_weights,output_bias}). For a
  RealmKnowledgeAugEncoder the function maps `cls/...` to the model's `cls` (RealmOnlyMLMHead,
  which has only `predictions`); on `cls/seq_relationship/output_bias` its lookup of the scope
  `seq_relationship` fails and is logged "Skipping" but the walk goes on (the `continue` is in
  the inner loop over the name's parts), and the leaf `output_bias` is then looked up as `bias`
  on RealmOnlyMLMHead itself, outside the try: AttributeError "'RealmOnlyMLMHead' object has
  no attribute 'bias'", and the load aborts. So the reference for bert/ is computed from a copy
  of the checkpoint that TensorFlow writes (tf.raw_ops.SaveV2) with every variable but those
  two, value for value: the variables realm-jax's import keeps too (it drops the NSP head).
  The script tries the checkpoint as it stands first and records the error in outputs.json
  ("load_failures"); if a later transformers loads it, that is recorded instead.
Parameters a load leaves at their random initialisation are recorded too ("not_loaded"):
the untied MLM decoders (cls.predictions.decoder.weight) of RealmEmbedder and RealmReader,
which no output here reads (transformers ties only RealmKnowledgeAugEncoder's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.deprecated.realm import (  # noqa: E402
    RealmConfig,
    RealmEmbedder,
    RealmForOpenQA,
    RealmKnowledgeAugEncoder,
    RealmReader,
    RealmScorer,
)
from transformers.models.deprecated.realm.modeling_realm import (  # noqa: E402
    load_tf_weights_in_realm,
)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FIXTURES = os.path.join(HERE, "..", "tests", "fixtures", "release")
EMBEDDER = ("embedder", "variables", "variables")
BERT = ("bert", "variables", "variables")
ORQA = ("orqa", "export", "best_default", "checkpoint", "model.ckpt-300")
BLOCK_EMB = ("embedder", "encoded", "encoded.ckpt")
NSP = "cls/seq_relationship/"  # BERT's next-sentence head: no place for it in HF's REALM
CANDIDATES, READER_ROWS, TOP_K, ANSWERS = 3, 4, 4, 2


def config() -> RealmConfig:
    """The fixtures' architecture (bench/make_release_fixtures.py; the heads are not in the
    checkpoint: 2, as tests/test_release_openqa.py runs it)."""
    return RealmConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=36,
        hidden_act="gelu_new",
        max_position_embeddings=24,
        type_vocab_size=2,
        retriever_proj_size=12,
        span_hidden_size=6,
        max_span_width=10,
        num_candidates=CANDIDATES,
        reader_beam_size=READER_ROWS,
        searcher_beam_size=TOP_K,
        num_block_records=20,
    )


# ------------------------------------------------------------------------------------ inputs
def _rows(rng, n: int, length: int, min_len: int, two_segments: bool):
    """(ids, mask, token types) [n, length]: ids in 1..99, zero-padded after a random length
    (the first row full); types 0 then 1 after a random cut when two_segments, 0 on padding."""
    ids = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), np.int64)
    types = np.zeros((n, length), np.int64)
    for r in range(n):
        used = length if r == 0 else int(rng.integers(min_len, length))
        ids[r, :used] = rng.integers(1, 100, used)
        mask[r, :used] = 1
        if two_segments:
            types[r, int(rng.integers(2, used - 1)) : used] = 1
    return ids, mask, types


def make_inputs(seed: int = 2024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    out["emb_ids"], out["emb_mask"], out["emb_type_ids"] = _rows(rng, 4, 12, 4, True)
    q = _rows(rng, 2, 10, 3, False)
    out["scorer_query_ids"], out["scorer_query_mask"], out["scorer_query_type_ids"] = q
    c = _rows(rng, 2 * CANDIDATES, 12, 4, True)
    for name, x in zip(("ids", "mask", "type_ids"), c):
        out[f"scorer_cand_{name}"] = x.reshape(2, CANDIDATES, 12)
    out["mlm_ids"], out["mlm_mask"], out["mlm_type_ids"] = _rows(rng, 3, 14, 5, True)
    out["qa_query_ids"], out["qa_query_mask"], out["qa_query_type_ids"] = _rows(
        rng, 3, 10, 3, False
    )
    # reader rows: question (type 0), then the block (type 1) ending with a separator, padding;
    # the block mask marks the block's wordpieces (HF: not special and type 1)
    length = 24
    ids, mask, types = (np.zeros((READER_ROWS, length), np.int64) for _ in range(3))
    block_mask = np.zeros((READER_ROWS, length), bool)
    starts = np.full((READER_ROWS, ANSWERS), -1, np.int64)
    ends = np.full((READER_ROWS, ANSWERS), -1, np.int64)
    for r in range(READER_ROWS):
        qlen = int(rng.integers(4, 8))
        used = length if r == 0 else int(rng.integers(qlen + 6, length))
        ids[r, :used] = rng.integers(1, 100, used)
        mask[r, :used] = 1
        types[r, qlen:used] = 1
        block_mask[r, qlen : used - 1] = True
        if r != 2:  # row 2: no answer in the block
            for a in range(1 + r % 2):
                s = int(rng.integers(qlen, used - 1))
                starts[r, a] = s
                ends[r, a] = min(s + int(rng.integers(0, 4)), used - 2)
    out.update(
        reader_ids=ids,
        reader_mask=mask,
        reader_type_ids=types,
        reader_block_mask=block_mask,
        reader_gold_starts=starts,
        reader_gold_ends=ends,
        reader_has_answers=(starts >= 0).any(1),
    )
    return out


# --------------------------------------------------------------------------------- loading
def load(cls, cfg: RealmConfig, *prefixes: str):
    """A fresh `cls` with every checkpoint at `prefixes` loaded by load_tf_weights_in_realm;
    returns (model in eval mode, names of parameters/buffers the loads left as initialised)."""
    torch.manual_seed(0)
    model = cls(cfg)
    before = {n: t.detach().clone() for n, t in _tensors(model)}
    for prefix in prefixes:
        load_tf_weights_in_realm(model, cfg, prefix)
    left = sorted(n for n, t in _tensors(model) if torch.equal(t, before[n]))
    return model.eval(), left


def _tensors(model):
    """The model's saved tensors: parameters (tied ones under each name) and block_emb."""
    return model.state_dict(keep_vars=True).items()


def without_nsp(prefix: str, out_prefix: str) -> list[str]:
    """Copy a checkpoint without BERT's next-sentence head (TensorFlow reads and writes it);
    returns the names left out."""
    reader = tf.train.load_checkpoint(prefix)
    names = sorted(reader.get_variable_to_shape_map())
    kept = [n for n in names if not n.startswith(NSP)]
    tf.raw_ops.SaveV2(
        prefix=out_prefix,
        tensor_names=kept,
        shape_and_slices=[""] * len(kept),
        tensors=[reader.get_tensor(n) for n in kept],
    )
    copy = tf.train.load_checkpoint(out_prefix)
    for n in kept:  # the copy holds the same values
        np.testing.assert_array_equal(copy.get_tensor(n), reader.get_tensor(n))
    return sorted(set(names) - set(kept))


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy()


# --------------------------------------------------------------------------------- outputs
@torch.no_grad()
def compute(fixtures: str, i: dict) -> tuple[dict, dict]:
    """({name: output array}, notes for outputs.json)."""
    cfg = config()
    path = {
        k: os.path.join(fixtures, *v)
        for k, v in dict(embedder=EMBEDDER, bert=BERT, orqa=ORQA, block_emb=BLOCK_EMB).items()
    }
    out, failures, not_loaded = {}, {}, {}

    emb, not_loaded["RealmEmbedder"] = load(RealmEmbedder, cfg, path["embedder"])
    out["emb_projected"] = _np(
        emb(
            _t(i["emb_ids"]), attention_mask=_t(i["emb_mask"]), token_type_ids=_t(i["emb_type_ids"])
        ).projected_score
    )
    scorer, not_loaded["RealmScorer"] = load(RealmScorer, cfg, path["embedder"])
    s = scorer(
        _t(i["scorer_query_ids"]),
        attention_mask=_t(i["scorer_query_mask"]),
        token_type_ids=_t(i["scorer_query_type_ids"]),
        candidate_input_ids=_t(i["scorer_cand_ids"]),
        candidate_attention_mask=_t(i["scorer_cand_mask"]),
        candidate_token_type_ids=_t(i["scorer_cand_type_ids"]),
    )
    out["scorer_relevance"] = _np(s.relevance_score)
    out["scorer_query_score"] = _np(s.query_score)
    out["scorer_candidate_score"] = _np(s.candidate_score)

    try:
        load(RealmKnowledgeAugEncoder, cfg, path["bert"])
        failures["bert"] = None
    except Exception as e:  # noqa: BLE001  (recorded, then the documented copy is used)
        failures["bert"] = f"{type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        dropped = without_nsp(path["bert"], os.path.join(tmp, "bert"))
        enc, not_loaded["RealmKnowledgeAugEncoder"] = load(
            RealmKnowledgeAugEncoder, cfg, os.path.join(tmp, "bert")
        )
    tied = enc.cls.predictions.decoder.weight is enc.realm.embeddings.word_embeddings.weight
    if not tied:
        raise AssertionError("RealmKnowledgeAugEncoder's decoder is not tied")
    out["mlm_logits"] = _np(
        enc(
            _t(i["mlm_ids"]), attention_mask=_t(i["mlm_mask"]), token_type_ids=_t(i["mlm_type_ids"])
        ).logits
    )

    qa, not_loaded["RealmForOpenQA"] = load(RealmForOpenQA, cfg, path["orqa"], path["block_emb"])
    query = qa.embedder(
        _t(i["qa_query_ids"]),
        attention_mask=_t(i["qa_query_mask"]),
        token_type_ids=_t(i["qa_query_type_ids"]),
    ).projected_score
    out["qa_query_emb"] = _np(query)
    out["qa_block_emb"] = _np(qa.block_emb)
    scores = torch.einsum("BD,QD->QB", qa.block_emb, query)
    out["qa_scores"] = _np(scores)
    top = torch.topk(scores, k=TOP_K, dim=-1)
    out["qa_top_ids"], out["qa_top_scores"] = _np(top.indices), _np(top.values)

    relevance = top.values[0]  # the first question's top blocks feed the reader rows
    rd = dict(
        input_ids=_t(i["reader_ids"]),
        attention_mask=_t(i["reader_mask"]),
        token_type_ids=_t(i["reader_type_ids"]),
    )
    bmask = _t(i["reader_block_mask"])
    hidden = qa.reader.realm(**rd)[0]
    span_logits, starts, ends = qa.reader.qa_outputs(hidden, bmask)
    out["reader_hidden"] = _np(hidden)
    out["reader_span_logits"] = _np(span_logits)
    out["reader_starts"], out["reader_ends"] = _np(starts), _np(ends)
    alone, not_loaded["RealmReader"] = load(RealmReader, cfg, path["orqa"])
    again = alone.qa_outputs(alone.realm(**rd)[0], bmask)[0]
    if not torch.equal(again, span_logits):
        raise AssertionError("RealmReader alone and RealmForOpenQA.reader differ")
    r = qa.reader(
        **rd,
        relevance_score=relevance,
        block_mask=bmask,
        start_positions=_t(i["reader_gold_starts"]),
        end_positions=_t(i["reader_gold_ends"]),
        has_answers=_t(i["reader_has_answers"]),
    )
    out["reader_relevance"] = _np(relevance)
    for name in ("loss", "retriever_loss", "reader_loss"):
        out[f"reader_{name}"] = _np(r[name]).astype(np.float32)
    out["reader_correct"] = _np(r.reader_correct)
    for name in ("block_idx", "candidate", "start_pos", "end_pos"):
        out[f"reader_{name}"] = _np(r[name]).reshape(-1).astype(np.int64)
    notes = {
        "load_failures": failures,
        "bert_left_out_of_the_copy": dropped,
        "not_loaded": not_loaded,
    }
    return out, notes


DESCRIPTIONS = {
    "emb_*": "inputs of RealmEmbedder (embedder/): ids [4, 12], attention mask, token types",
    "emb_projected": "RealmEmbedder(...).projected_score [4, 12]",
    "scorer_query_*": "RealmScorer query inputs [2, 10] (embedder/)",
    "scorer_cand_*": "RealmScorer candidate inputs [2, 3, 12]",
    "scorer_relevance": "RealmScorer relevance_score [2, 3]",
    "scorer_query_score": "RealmScorer query_score [2, 12]",
    "scorer_candidate_score": "RealmScorer candidate_score [2, 3, 12]",
    "mlm_*": "inputs of RealmKnowledgeAugEncoder (bert/ without cls/seq_relationship) [3, 14]",
    "mlm_logits": "RealmKnowledgeAugEncoder(...).logits [3, 14, 100], every position",
    "qa_query_*": "questions [3, 10]: type 0, mask = ids != 0 (orqa/ query embedder)",
    "qa_query_emb": "RealmForOpenQA.embedder(...).projected_score [3, 12]",
    "qa_block_emb": "RealmForOpenQA.block_emb as loaded from embedder/encoded/encoded.ckpt",
    "qa_scores": "einsum('BD,QD->QB', block_emb, query_emb) [3, 20] (RealmForOpenQA.forward's)",
    "qa_top_ids": "torch.topk(qa_scores, 4).indices [3, 4]",
    "qa_top_scores": "torch.topk(qa_scores, 4).values [3, 4]",
    "reader_ids/mask/type_ids/block_mask": "RealmReader inputs [4, 24] (orqa/ reader)",
    "reader_gold_starts/ends": "gold spans [4, 2] (-1: none; row 2 has none)",
    "reader_has_answers": "[4] whether a row has a gold span",
    "reader_hidden": "reader.realm(...)[0] [4, 24, 16]: the BERT output the span head reads",
    "reader_span_logits": "reader.qa_outputs(reader.realm(...)[0], block_mask)[0] [4, 195]: "
    "span logits before the retrieval score is added; float32 min + logit outside the block",
    "reader_starts/ends": "the candidate spans' start/end positions [195]",
    "reader_relevance": "qa_top_scores[0]: the relevance_score given to RealmReader.forward",
    "reader_loss/reader_retriever_loss/reader_reader_loss": "RealmReaderOutput's loss, "
    "retriever_loss, reader_loss (scalars)",
    "reader_correct": "RealmReaderOutput.reader_correct [4, 195]",
    "reader_block_idx/candidate/start_pos/end_pos": "RealmReaderOutput's predictions [1]",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default=os.path.normpath(DEFAULT_FIXTURES))
    ap.add_argument("--out", default=None, help="default: <fixtures>/reference/outputs.npz")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out_path = args.out or os.path.join(args.fixtures, "reference", "outputs.npz")
    inputs = make_inputs()
    outputs, notes = compute(args.fixtures, inputs)
    np.savez_compressed(out_path, **inputs, **outputs)
    meta = {
        "made_by": "bench/make_release_outputs.py (.venv-tfpeer)",
        "command": " ".join(
            [os.path.relpath(sys.executable), os.path.relpath(__file__), *sys.argv[1:]]
        ),
        "versions": {
            "transformers": transformers.__version__,
            "tensorflow": tf.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "config": config().to_diff_dict(),
        "arrays": DESCRIPTIONS,
        **notes,
    }
    with open(os.path.splitext(out_path)[0] + ".json", "w") as f:
        json.dump(meta, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    print(
        f"wrote {out_path}: {os.path.getsize(out_path) / 1024:.0f} KiB; "
        f"load failures: {notes['load_failures']}"
    )


if __name__ == "__main__":
    main()
