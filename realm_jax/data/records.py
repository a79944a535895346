"""The records of the prepared datasets, as every `prepare` engine writes them: the blocks and
examples schemas (TFDS builders), one record of each, the span chooser and the sentence masking
both engines run, the eval split, the fingerprint's fields and a dataset written in process.

data/prepare.py chooses an engine and publishes what it built; the engines (local_prepare: in
process; beam_prepare: Apache Beam; release_prepare: the release's block records, streamed)
import this module and never each other's driver, so no engine imports prepare. The read side
of these datasets is data/datasets.py.
"""

from __future__ import annotations

import collections
import os
import shutil

import numpy as np
import tensorflow_datasets as tfds

from realm_jax import tokenization as tk
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import masking
from realm_jax.data.datasets import PrepareError

FP_FIELDS = (
    "block_len",
    "query_len",
    "max_predictions",
    "min_sentence_tokens",
    "masking",
    "ner_model",
    "random_span_max",
    "skip_bad_input",
    "seed",
    "eval_fraction",
    "eval_split_key",
)
CHUNK = 512  # documents tokenised per batch


class _Builder(tfds.core.GeneratorBasedBuilder):
    """Writes the records passed at construction, in order (no TFDS shuffling)."""

    VERSION = tfds.core.Version("1.0.0")

    # TFDS prints "Downloading and preparing dataset ..." and "Dataset ... downloaded and
    # prepared to ..." for every builder; these download nothing (prepare logs its own summary)
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    FEATURES: dict = {}

    def __init__(self, *, records=(), **kwargs):
        self._records = records
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        feats = tfds.features.FeaturesDict(self.FEATURES)
        return tfds.core.DatasetInfo(builder=self, features=feats, disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        yield from enumerate(self._records)


_INT_SEQ = tfds.features.Tensor(shape=(None,), dtype=np.int32)


class RealmBlocks(_Builder):
    FEATURES = {
        "block_id": np.int64,
        "doc_id": tfds.features.Text(),
        "title": tfds.features.Text(),
        "text": tfds.features.Text(),
        "token_ids": _INT_SEQ,
        "sentence_starts": _INT_SEQ,
    }


class RealmExamples(_Builder):
    FEATURES = {
        "example_id": np.int64,
        "block_id": np.int64,
        "doc_id": tfds.features.Text(),
        "title": tfds.features.Text(),  # the sentence's document's title (v3)
        "text": tfds.features.Text(),
        "token_ids": _INT_SEQ,
        "span_starts": _INT_SEQ,
        "span_ends": _INT_SEQ,
        "span_labels": tfds.features.Text(),
    }


# ------------------------------------------------------------------------------------- records
def chunks(it, n: int):
    """Lists of n items of it (the last one shorter)."""
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def split_key(data, doc_id: str, title: str) -> str:
    """What decides a sentence's eval split: its title or doc id (data.eval_split_key)."""
    if data.eval_split_key not in ("title", "doc_id"):
        raise PrepareError(
            f"data.eval_split_key must be 'title' or 'doc_id', got {data.eval_split_key!r}"
        )
    return title if data.eval_split_key == "title" and title else doc_id


def masking_label(masker: masking.Masker, given) -> str:
    """How the examples' spans are found, for the progress bar: random, NER or annotated."""
    if masker.mode != "salient":
        return "random"
    return "NER" if given is None else "annotated"


def masked_sentences(data, masker, texts: list[str], given, stats, base: int = 0):
    """(i, wordpieces, spans) for every sentence texts[i], in order; spans is empty for a
    sentence too short (counted as skipped_short_sentence) or without a usable span. given:
    each sentence's annotated span candidates, or None (NER finds them). base: the index of
    texts[0] among all the corpus's sentences (random masking's seed)."""
    encs = tk.wordpieces(texts)
    keep = [len(e.ids) >= data.min_sentence_tokens for e in encs]
    stats["skipped_short_sentence"] += len(texts) - sum(keep)
    kept = [i for i, k in enumerate(keep) if k]
    if given is None:
        cands = iter(masker.candidates([texts[i] for i in kept]))
    else:  # the annotated spans of REALM's shards: no NER
        cands = iter([given[i] if masker.mode == "salient" else [] for i in kept])
    for i, (text, enc) in enumerate(zip(texts, encs, strict=True)):
        spans = masker.choices(base + i, text, enc.offsets, next(cands)) if keep[i] else []
        yield i, enc, spans


def make_masker(
    data, stats: collections.Counter, ner_processes: int, ner: bool = True
) -> masking.Masker:
    """The span chooser both engines use (the Beam one runs one per worker, ner_processes=1);
    ner=False when the text brings its salient spans (no spaCy pipeline is loaded)."""
    return masking.Masker(
        data["masking"],
        ner_model=data["ner_model"],
        max_predictions=data["max_predictions"],
        max_tokens=data["query_len"] - 2,
        random_span_max=data["random_span_max"],
        seed=data["seed"],
        stats=stats,
        ner_processes=ner_processes,
        ner=ner,
    )


def example_record(example_id, block_id, doc_id, title, text, ids, spans, query_len) -> dict:
    """One examples-dataset record; spans are masking.Span tuples (positions without [CLS]).
    title: the title of the sentence's document (its block's, or a separate text's document's:
    the held-out evaluation counts retrieved blocks of that title as the sentence's own
    document, pretrain/evaluation.py)."""
    return {
        "example_id": example_id,
        "block_id": block_id,
        "doc_id": doc_id,
        "title": title,
        "text": text,
        "token_ids": np.asarray(tk.query_ids(ids, query_len), np.int32),
        "span_starts": np.asarray([a + 1 for a, _, _ in spans], np.int32),  # +1: [CLS]
        "span_ends": np.asarray([b + 1 for _, b, _ in spans], np.int32),
        "span_labels": ",".join(label for _, _, label in spans),
    }


def block_record(b: corpus_lib.Block) -> dict:
    """One blocks-dataset record."""
    return {
        "block_id": b.block_id,
        "doc_id": b.doc_id,
        "title": b.title,
        "text": b.text,
        "token_ids": np.asarray(b.token_ids, np.int32),
        "sentence_starts": np.asarray(b.sentence_starts, np.int32),
    }


def write_dataset(cls, records, folder: str) -> None:
    """Write the records, in order, as dataset `cls` into folder (array_record, in process)."""
    builder = cls(records=records, data_dir=folder)
    # TFDS's own output is about its downloads, which these in-process records have none of
    # ("Downloading and preparing dataset Unknown size ...", "Generating splits...", a bar
    # per split): its bars off while it writes (the builder's messages: _Builder)
    tfds.disable_progress_bar()
    try:
        builder.download_and_prepare(
            file_format="array_record", download_dir=os.path.join(folder, "downloads")
        )
    finally:
        tfds.enable_progress_bar()
    shutil.rmtree(os.path.join(folder, "downloads"), ignore_errors=True)
