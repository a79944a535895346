"""Write tests/fixtures/release/: tiny stand-ins of the REALM/ORQA release's files, made by the
real libraries (TensorFlow's Saver and TFRecordWriter, numpy's pickling np.save), with the
reference values TensorFlow itself reads back. Run in a side venv that has TensorFlow (the
project's venv must not get it):

    python3.11 -m venv .venv-tf && .venv-tf/bin/pip install tensorflow-cpu
    .venv-tf/bin/python bench/make_release_fixtures.py [--out tests/fixtures/release]

Never imports realm_jax. What it writes (hidden 16, 2 layers, 100 ids, projection 12):
  embedder/variables/variables.*      cc_news_pretrained/embedder (a TF-Hub module's variables):
                                      BERT under module/module/module/bert/, its MLM head under
                                      module/module/module/cls/predictions/, the 128-d (here
                                      12-d) projection under module/module/{dense,LayerNorm}/
  embedder/encoded/encoded.ckpt.*     the release's block embeddings: one variable block_emb
                                      [num_blocks, proj] (ORQA encode_blocks.py), row i = block i
  bert/variables/variables.*          cc_news_pretrained/bert: bert/..., cls/predictions/...,
                                      cls/seq_relationship/... (a BERT hub module's heads)
  orqa/export/best_default/checkpoint/model.ckpt-300.*
                                      orqa_nq_model_from_realm's best checkpoint (no state
                                      file, as ORQA's exporter leaves it): query embedder under
                                      module/module/module/module/bert/ + module/module/module/
                                      {dense,LayerNorm}/, reader BERT under reader/module/bert/,
                                      span head reader/dense (start/end projections, [H, 2S]),
                                      reader/dense_1 ([S, 1]), reader/layer_normalization, Adam
                                      slots (<var>/adam_m, adam_v) and global_step
  orqa/params.json                    ORQA's run parameters (model_dir/params.json)
  misc/model.ckpt-7.* + misc/checkpoint   every dtype the reader handles, a `checkpoint` state
                                      file, scalars, an empty tensor, strings
  reference/<name>.npz + .json        each checkpoint's variables as tf.train.load_checkpoint
                                      reads them (bfloat16 as its uint16 bits, strings as a
                                      JSON list of base64), with TF's dtype names and shapes
  blocks.tfr, titles.tfr              ORQA's block corpus: record i = block i's text / title
  block_records.npy                   HuggingFace's copy: np.save(allow_pickle=True) of an
                                      object array of the blocks' UTF-8 bytes
  blocks.json                         the same blocks and titles as written, for the tests
The sizes of the release (BERT-base, 128-d, 13,353,718 blocks) differ; the names, layouts and
formats are the release's (language/realm, language/orqa, and transformers'
load_tf_weights_in_realm, which maps them).
"""

from __future__ import annotations

import argparse
import base64
import json
import os

import numpy as np

HIDDEN, LAYERS, INTER, VOCAB, MAX_POS, TYPES = 16, 2, 36, 100, 24, 2
PROJ, SPAN = 12, 6  # sizes that differ, so a transposed kernel cannot pass unnoticed

# Blocks as ORQA's wiki preprocessor makes them: sentences of one article joined by spaces,
# every block of an article with the article's title.
ARTICLES = [
    (
        "Albert Einstein",
        [
            "Albert Einstein was a German-born theoretical physicist.",
            "He developed the theory of relativity in 1905 and 1915.",
            "Einstein received the 1921 Nobel Prize in Physics.",
            "He emigrated to the United States in 1933 and worked in Princeton.",
        ],
    ),
    (
        "Marie Curie",
        [
            "Marie Skłodowska-Curie was a Polish and naturalised-French physicist.",
            "She was the first woman to win a Nobel Prize.",
            "Curie discovered polonium and radium with Pierre Curie.",
        ],
    ),
    (
        "Tokyo",
        [
            "Tokyo (東京) is the capital of Japan.",
            "The Greater Tokyo Area is the most populous metropolitan area in the world.",
            "Tokyo hosted the Summer Olympics in 1964 and 2021.",
        ],
    ),
    (
        "Café",
        [
            "A café is an establishment that serves coffee and other drinks.",
            "In Europe cafés often serve light meals such as sandwiches.",
        ],
    ),
]
NUM_BLOCKS = 20


def make_blocks() -> tuple[list[str], list[str]]:
    """(texts, titles): 20 blocks of one to three sentences each; block 7 is long (more
    wordpieces than a 128-wordpiece block holds) and block 13 holds a single word."""
    rng = np.random.default_rng(0)
    texts, titles = [], []
    while len(texts) < NUM_BLOCKS:
        title, sents = ARTICLES[len(texts) % len(ARTICLES)]
        k = int(rng.integers(1, 4))
        start = int(rng.integers(0, len(sents)))
        texts.append(" ".join(sents[start : start + k]))
        titles.append(title)
    texts[7] = " ".join(s for _, sents in ARTICLES for s in sents)  # a long block
    texts[13] = "Coffee."
    return texts, titles


# ------------------------------------------------------------------------- variable layouts
def bert_vars(prefix: str) -> dict[str, tuple[int, ...]]:
    """Google BERT's TF1 variables (modeling.py) under `prefix` + "bert/"."""
    p = prefix + "bert/"
    out = {
        p + "embeddings/word_embeddings": (VOCAB, HIDDEN),
        p + "embeddings/token_type_embeddings": (TYPES, HIDDEN),
        p + "embeddings/position_embeddings": (MAX_POS, HIDDEN),
        p + "embeddings/LayerNorm/gamma": (HIDDEN,),
        p + "embeddings/LayerNorm/beta": (HIDDEN,),
    }
    for i in range(LAYERS):
        lp = f"{p}encoder/layer_{i}/"
        for name in ("query", "key", "value"):
            out[f"{lp}attention/self/{name}/kernel"] = (HIDDEN, HIDDEN)
            out[f"{lp}attention/self/{name}/bias"] = (HIDDEN,)
        out[lp + "attention/output/dense/kernel"] = (HIDDEN, HIDDEN)
        out[lp + "attention/output/dense/bias"] = (HIDDEN,)
        out[lp + "attention/output/LayerNorm/gamma"] = (HIDDEN,)
        out[lp + "attention/output/LayerNorm/beta"] = (HIDDEN,)
        out[lp + "intermediate/dense/kernel"] = (HIDDEN, INTER)
        out[lp + "intermediate/dense/bias"] = (INTER,)
        out[lp + "output/dense/kernel"] = (INTER, HIDDEN)
        out[lp + "output/dense/bias"] = (HIDDEN,)
        out[lp + "output/LayerNorm/gamma"] = (HIDDEN,)
        out[lp + "output/LayerNorm/beta"] = (HIDDEN,)
    out[p + "pooler/dense/kernel"] = (HIDDEN, HIDDEN)
    out[p + "pooler/dense/bias"] = (HIDDEN,)
    return out


def mlm_vars(prefix: str, nsp: bool = False) -> dict[str, tuple[int, ...]]:
    """BERT's pre-training heads (run_pretraining.py) under `prefix` + "cls/"."""
    p = prefix + "cls/"
    out = {
        p + "predictions/transform/dense/kernel": (HIDDEN, HIDDEN),
        p + "predictions/transform/dense/bias": (HIDDEN,),
        p + "predictions/transform/LayerNorm/gamma": (HIDDEN,),
        p + "predictions/transform/LayerNorm/beta": (HIDDEN,),
        p + "predictions/output_bias": (VOCAB,),
    }
    if nsp:
        out[p + "seq_relationship/output_weights"] = (2, HIDDEN)
        out[p + "seq_relationship/output_bias"] = (2,)
    return out


def embedder_vars(outer: str) -> dict[str, tuple[int, ...]]:
    """The REALM embedder module: BERT one `module/` deeper than its projection (ICT's
    module_fn wraps the BERT hub module and adds dense + LayerNorm)."""
    out = bert_vars(outer + "module/")
    out.update(mlm_vars(outer + "module/"))
    out[outer + "dense/kernel"] = (HIDDEN, PROJ)
    out[outer + "dense/bias"] = (PROJ,)
    out[outer + "LayerNorm/gamma"] = (PROJ,)
    out[outer + "LayerNorm/beta"] = (PROJ,)
    return out


def orqa_vars() -> dict[str, tuple[int, ...]]:
    """orqa_model.py's model_fn: the retriever hub module instantiated as `module`, the reader
    inside variable_scope("reader") with its hub module and the span head's layers."""
    out = embedder_vars("module/module/module/")
    out.update(bert_vars("reader/module/"))
    out.update(mlm_vars("reader/module/"))
    out["reader/dense/kernel"] = (HIDDEN, 2 * SPAN)
    out["reader/dense/bias"] = (2 * SPAN,)
    out["reader/layer_normalization/gamma"] = (SPAN,)
    out["reader/layer_normalization/beta"] = (SPAN,)
    out["reader/dense_1/kernel"] = (SPAN, 1)
    out["reader/dense_1/bias"] = (1,)
    for name in ("reader/dense/kernel", "module/module/module/dense/kernel"):
        out[name + "/adam_m"] = out[name]
        out[name + "/adam_v"] = out[name]
    return out


# --------------------------------------------------------------------------------- writing
def save_checkpoint(tf, prefix: str, values: dict, *, global_step=None, state_file=False):
    """Save `values` ({name: array}) with a TF1 Saver under `prefix`; names are built with
    nested variable scopes, as the release's graphs made them."""
    graph = tf.Graph()
    with graph.as_default():
        variables = []
        for name, value in values.items():
            *scopes, leaf = name.split("/")
            with tf.variable_scope("/".join(scopes) if scopes else tf.get_variable_scope()):
                if value.dtype.kind in "SO":
                    v = tf.get_variable(leaf, initializer=tf.constant(list(value)), dtype=tf.string)
                else:
                    v = tf.get_variable(leaf, initializer=tf.constant(value))
            if v.op.name != name:
                raise AssertionError(f"made {v.op.name}, wanted {name}")
            variables.append(v)
        if global_step is not None:
            variables.append(tf.train.get_or_create_global_step())
        saver = tf.train.Saver(variables)
        with tf.Session(graph=graph) as sess:
            sess.run(tf.global_variables_initializer())
            if global_step is not None:
                sess.run(tf.assign(tf.train.get_global_step(), global_step))
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            saved = saver.save(
                sess, prefix, global_step=global_step, write_meta_graph=False, write_state=False
            )
    if state_file:  # relative, as a checkpoint folder that was copied elsewhere needs it
        tf.train.update_checkpoint_state(os.path.dirname(saved), os.path.basename(saved))
    return saved


def random_values(shapes: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.5, s).astype(np.float32) for n, s in shapes.items()}


def misc_values(tf) -> dict[str, np.ndarray]:
    """Every dtype the reader supports, and awkward shapes."""
    rng = np.random.default_rng(7)
    return {
        "dtypes/f32": rng.normal(size=(3, 5)).astype(np.float32),
        "dtypes/f16": rng.normal(size=(4, 3)).astype(np.float16),
        "dtypes/bf16": rng.normal(size=(6,)).astype(tf.bfloat16.as_numpy_dtype),
        "dtypes/f64": rng.normal(size=(2, 2)).astype(np.float64),
        "dtypes/i32": rng.integers(-(2**31), 2**31 - 1, size=(7,)).astype(np.int32),
        "dtypes/i64": rng.integers(-(2**62), 2**62, size=(2, 3)).astype(np.int64),
        "dtypes/u8": rng.integers(0, 255, size=(5,)).astype(np.uint8),
        "dtypes/i8": rng.integers(-128, 127, size=(5,)).astype(np.int8),
        "dtypes/bool": rng.random(9) > 0.5,
        "dtypes/scalar": np.float32(3.25),
        "dtypes/empty": np.zeros((0, 4), np.float32),
        "dtypes/big": rng.normal(size=(40, 30)).astype(np.float32),
        "dtypes/strings": np.array(["", "block text", "東京 and café", "x" * 300], dtype=object),
    }


def write_reference(tf, prefix: str, out: str) -> None:
    """What TensorFlow reads back from the checkpoint at `prefix`: out.npz + out.json."""
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    arrays, meta = {}, {}
    for name, shape in sorted(reader.get_variable_to_shape_map().items()):
        value = reader.get_tensor(name)
        dt = dtypes[name]
        entry = {"dtype": dt.name, "shape": list(shape)}
        if dt == tf.string:
            flat = np.asarray(value, dtype=object).reshape(-1)
            entry["base64"] = [base64.b64encode(x).decode() for x in flat]
        elif dt == tf.bfloat16:
            arrays[name] = np.asarray(value).view(np.uint16)
        else:
            arrays[name] = np.asarray(value)
        meta[name] = entry
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump({"prefix": os.path.basename(prefix), "variables": meta}, f, indent=1)


def write_blocks(tf, out: str) -> None:
    texts, titles = make_blocks()
    for name, items in (("blocks.tfr", texts), ("titles.tfr", titles)):
        with tf.io.TFRecordWriter(os.path.join(out, name)) as w:
            for s in items:
                w.write(s.encode("utf-8"))
    records = np.array([t.encode("utf-8") for t in texts], dtype=object)
    np.save(os.path.join(out, "block_records.npy"), records, allow_pickle=True)
    with open(os.path.join(out, "blocks.json"), "w") as f:
        json.dump({"texts": texts, "titles": titles}, f, ensure_ascii=False, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(here, "tests", "fixtures", "release"))
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow.compat.v1 as tf

    tf.disable_v2_behavior()
    out, ref = args.out, os.path.join(args.out, "reference")
    os.makedirs(ref, exist_ok=True)

    made = {
        "embedder": save_checkpoint(
            tf,
            os.path.join(out, "embedder", "variables", "variables"),
            random_values(embedder_vars("module/module/"), 1),
        ),
        "bert": save_checkpoint(
            tf,
            os.path.join(out, "bert", "variables", "variables"),
            random_values({**bert_vars(""), **mlm_vars("", nsp=True)}, 2),
        ),
        "orqa": save_checkpoint(
            tf,
            os.path.join(out, "orqa", "export", "best_default", "checkpoint", "model.ckpt"),
            random_values(orqa_vars(), 3),
            global_step=300,
        ),
        "misc": save_checkpoint(
            tf,
            os.path.join(out, "misc", "model.ckpt"),
            misc_values(tf),
            global_step=7,
            state_file=True,
        ),
    }
    block_emb = np.random.default_rng(4).normal(size=(NUM_BLOCKS, PROJ)).astype(np.float32)
    made["block_emb"] = save_checkpoint(
        tf, os.path.join(out, "embedder", "encoded", "encoded.ckpt"), {"block_emb": block_emb}
    )
    with open(os.path.join(out, "orqa", "params.json"), "w") as f:
        json.dump(
            {
                "retriever_module_path": "gs://realm-data/cc_news_pretrained/embedder",
                "reader_module_path": "gs://realm-data/cc_news_pretrained/bert",
                "block_records_path": "gs://orqa-data/enwiki-20181220/blocks.tfr",
                "num_block_records": NUM_BLOCKS,
                "span_hidden_size": SPAN,
                "max_span_width": 10,
                "reader_seq_len": 64,
            },
            f,
            indent=1,
        )
    for name, prefix in made.items():
        write_reference(tf, prefix, os.path.join(ref, name))
    write_blocks(tf, out)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(out) for f in fs_)
    print(f"wrote {out}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
