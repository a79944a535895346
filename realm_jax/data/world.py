"""`realm-jax world`: a seeded generator of a controlled knowledge world.

    python -m realm_jax world --config configs/realm.py:world --workdir runs/world \\
        [--config.world.entities=200 --config.world.seed=1 ...]

A world is a set of made-up people, each with three attributes: a city (one of CITIES), a birth
year (1900-1999) and a profession (one of PROFESSIONS); every city, year and profession is ONE
wordpiece of the bert-base-uncased vocab. config.world.entities of them are told about by a
pre-training text; config.world.distractors more have a knowledge document that the text never
mentions. No two people share their (city, profession), (profession, year) or (city, year) pair,
so two of a person's attributes identify that one person. Names (config.world.names) are two
made-up words built from syllables ("made_up": never a word of the vocab, never holding a city
or profession, unique, and no name is the start of another), or two ordinary words of the vocab
("words": each ONE wordpiece, alphabetic, 5-10 letters, no city or profession; every word names
at most one person's first part and one's last part, so that a BERT's word embeddings, which
know every part, can tell the people apart: "Harbor Quill").

Written into --workdir (config.world: entities, distractors, sentences_per_entity, mention,
seed, shards):
  corpus.jsonl   the knowledge corpus, one document per person (entities and distractors, in a
                 seeded order): {"id": "person-00042", "title": <full name>, "text": a sentence
                 per attribute, templates and order drawn per person}; fits one 64-wordpiece
                 block with its title (data/corpus.py reads it)
  text/world-<i>-of-<n>.tfrecord.gz
                 the pre-training text in REALM's annotated-shard format (interop/realm_records):
                 one document per entity, titled with the person's name (the title of their
                 knowledge document), of sentences_per_entity sentences that each restate ONE
                 attribute in words other than the knowledge document's, cycling through the
                 attributes; each sentence's one annotated span is that attribute's value.
                 mention="attributes": a sentence names its person by the two other attributes
                 ("The baker born in 1957 calls Lisbon home.") instead of the name;
                 mention="described": as "attributes" with the profession described in other
                 words ("The person who kneads dough before sunrise, born in 1957, calls Lisbon
                 home."), so BM25 matches the city or year alone (DESCRIPTIONS)
  qa.jsonl       SQuAD-style questions, one per attribute of every entity: {"question",
                 "answers": [value], "gold_passage": <corpus id>, "title": <name>, "id"}
                 (qa/answers.py read_questions, format auto)
  people.jsonl   the attribute table: {"id", "name", "city", "year", "profession",
                 "distractor"} in id order
  world.json     the manifest: FORMAT_VERSION, the config.world values, counts, the files and
                 their sha256, the longest document and sentence in wordpieces. Written first
                 (complete: false) and again last (complete: true).
The same config.world gives byte-identical files (each part draws from its own random stream
seeded by config.world.seed, so the people do not depend on the text's settings). A folder that
holds a world of other config.world values (or world files without a manifest) is refused;
the same values are written again (each file replaced atomically).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import random
import re
import time

import numpy as np

from realm_jax import fs
from realm_jax import tokenization as tk
from realm_jax.config import ConfigError
from realm_jax.interop import realm_records

log = logging.getLogger("realm_jax.world")

FORMAT_VERSION = 1
MANIFEST = "world.json"
CORPUS = "corpus.jsonl"
TEXT_DIR = "text"
QA = "qa.jsonl"
PEOPLE = "people.jsonl"
MENTIONS = ("name", "attributes", "described")
NAMES = ("made_up", "words")
ATTRIBUTES = ("city", "year", "profession")

# Well-known cities and professions, each one wordpiece of bert-base-uncased (tests check it);
# 70 x 48 (city, profession) pairs leave room for the default 2,000 people.
CITIES = (
    "Amsterdam Athens Atlanta Baghdad Bangkok Barcelona Beijing Berlin Bogota Boston Brussels "
    "Budapest Cairo Caracas Chicago Copenhagen Dallas Delhi Denver Dubai Dublin Edinburgh "
    "Florence Frankfurt Geneva Glasgow Hamburg Havana Helsinki Houston Istanbul Jakarta Kyoto "
    "Lagos Lima Lisbon Liverpool London Madrid Manchester Manila Melbourne Mexico Miami Milan "
    "Montreal Moscow Mumbai Munich Nairobi Naples Osaka Oslo Paris Prague Rome Santiago Seattle "
    "Seoul Shanghai Singapore Stockholm Sydney Tehran Tokyo Toronto Venice Vienna Warsaw Zurich"
).split()
PROFESSIONS = (
    "accountant actor architect baker banker blacksmith butcher carpenter chef chemist composer "
    "dancer dentist doctor economist engineer farmer fisherman gardener historian journalist "
    "judge lawyer librarian mechanic merchant musician novelist nurse painter photographer "
    "physicist pianist pilot poet potter priest sailor sculptor shepherd singer soldier surgeon "
    "tailor teacher translator violinist writer"
).split()
YEARS = tuple(range(1900, 2000))

# The knowledge documents' sentences, one per attribute ({a}: the profession's article).
KNOWLEDGE = {
    "city": ("{name} lives in {city}.", "{name} resides in {city}."),
    "year": ("{name} was born in {year}.", "{name} was born in the year {year}."),
    "profession": ("{name} works as {a} {profession}.", "{name} is employed as {a} {profession}."),
}
# The pre-training text restates an attribute in other words (its span: the attribute).
TEXT_BY_NAME = {
    "city": (
        "{city} is the home of {name}.",
        "{name} has made a home in {city}.",
        "The city of {city} is where {name} keeps a house.",
    ),
    "year": (
        "{name} came into the world in {year}.",
        "The year {year} saw the birth of {name}.",
        "{name} first drew breath in {year}.",
    ),
    "profession": (
        "By trade, {name} is {a} {profession}.",
        "{name} earns a living as {a} {profession}.",
        "To make ends meet, {name} toils as {a} {profession}.",
    ),
}
# mention="attributes": the person is the one with the two other attributes (unique pairs).
TEXT_BY_ATTRIBUTES = {
    "city": (
        "The {profession} born in {year} calls {city} home.",
        "{city} is the home of the {profession} who came into the world in {year}.",
        "The {profession} who first drew breath in {year} keeps a house in {city}.",
    ),
    "year": (
        "The {profession} from {city} came into the world in {year}.",
        "The year {year} saw the birth of the {profession} who calls {city} home.",
        "The {profession} living in {city} first drew breath in {year}.",
    ),
    "profession": (
        "By trade, the person from {city} born in {year} is {a} {profession}.",
        "The {city} resident born in {year} earns a living as {a} {profession}.",
        "The person who came into the world in {year} and calls {city} home toils as "
        "{a} {profession}.",
    ),
}
# mention="described": as "attributes", but the profession that identifies the person is
# described in words the knowledge document never uses ("the one who bakes bread" for its
# "baker"): BM25 matches the sentence's city or year alone, which ~1% of the people share,
# and no longer finds the one document; a retriever that learns what "kneads dough" means
# can. A sentence that masks the profession names the person by city and year as
# "attributes" does (BM25 finds those). No description shares a word with a profession, a
# city, a knowledge-document template or another description, stopwords aside
# (tests/unit/test_world.py).
DESCRIPTIONS = {
    "accountant": "keeps the ledgers of firms",
    "actor": "stars in films",
    "architect": "draws plans for towers",
    "baker": "kneads dough before sunrise",
    "banker": "grants loans at a bank counter",
    "blacksmith": "hammers hot iron at an anvil",
    "butcher": "carves joints of beef",
    "carpenter": "builds cabinets of timber",
    "chef": "runs a restaurant kitchen",
    "chemist": "mixes reagents in flasks",
    "composer": "scores symphonies for orchestras",
    "dancer": "performs ballet",
    "dentist": "drills and fills teeth",
    "doctor": "examines patients in a clinic",
    "economist": "forecasts inflation",
    "engineer": "designs bridges and engines",
    "farmer": "harvests wheat fields",
    "fisherman": "casts nets from a trawler",
    "gardener": "prunes hedges and roses",
    "historian": "studies ancient archives",
    "journalist": "reports the news for a paper",
    "judge": "presides over trials",
    "lawyer": "argues cases to juries",
    "librarian": "catalogues books for readers",
    "mechanic": "repairs car gearboxes",
    "merchant": "trades spices and silk",
    "musician": "plays gigs with a band",
    "novelist": "publishes long fiction",
    "nurse": "tends the sick on hospital wards",
    "painter": "covers canvases with oils",
    "photographer": "shoots portraits with a camera",
    "physicist": "measures particles and forces",
    "pianist": "gives recitals at the keyboard",
    "pilot": "flies airliners",
    "poet": "rhymes verses and sonnets",
    "potter": "throws clay on a wheel",
    "priest": "leads mass in a parish",
    "sailor": "crews ships on the ocean",
    "sculptor": "chisels marble statues",
    "shepherd": "herds flocks of sheep",
    "singer": "records songs and albums",
    "soldier": "serves in an infantry regiment",
    "surgeon": "operates in theatre",
    "tailor": "stitches suits to measure",
    "teacher": "instructs pupils in a school",
    "translator": "renders texts into other languages",
    "violinist": "bows a fiddle in a quartet",
    "writer": "drafts essays and stories",
}
TEXT_DESCRIBED = {
    "city": (
        "The person who {job}, born in {year}, calls {city} home.",
        "{city} is the home of the person born in {year} who {job}.",
        "The one who {job} and first drew breath in {year} keeps a house in {city}.",
    ),
    "year": (
        "The person from {city} who {job} came into the world in {year}.",
        "The year {year} saw the birth of the one who {job} and calls {city} home.",
        "Living in {city}, the person who {job} first drew breath in {year}.",
    ),
    "profession": TEXT_BY_ATTRIBUTES["profession"],  # by city and year: BM25 finds these
}
QUESTIONS = {
    "city": ("Where does {name} live?", "In which city does {name} live?"),
    "year": ("In what year was {name} born?", "When was {name} born?"),
    "profession": ("What does {name} work as?", "What is the profession of {name}?"),
}

# Names: syllables (onset + vowel + coda), a first name of two, a last name of two or three
# or two and an ending.
_ONSETS = (
    "b br c ch d dr f g gr h j k kr l m n p pr qu r s sh st t th tr v w z".split()
    + ["", ""]  # a syllable may start with its vowel
)
_VOWELS = "a e i o u a e i o ae ai ea ei ia io ou y".split()
_CODAS = "l n r s m nd rt sk th x".split() + [""] * 6
_ENDINGS = "ish ov ek and ar en ius ett ork ane wyn oth".split()
_MAX_PART_PIECES = 3  # wordpieces of one name part: keeps every document short


class WorldError(ValueError):
    """A workdir that cannot take this world (it holds another one)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """config.world, checked."""

    entities: int
    distractors: int
    sentences_per_entity: int
    mention: str
    seed: int
    shards: int
    names: str = "made_up"

    @classmethod
    def from_config(cls, config) -> Settings:
        if "world" not in config:
            raise ConfigError(
                "this config has no world section: use configs/realm.py:world (or add a world "
                "section: entities, distractors, sentences_per_entity, mention, seed, shards)"
            )
        w = config.world
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in w and field.default is not dataclasses.MISSING:
                continue
            if field.name not in w:
                raise ConfigError(f"config.world has no {field.name!r} (configs/realm.py:world)")
            values[field.name] = w[field.name]
        s = cls(**values)
        s.check()
        return s

    def check(self) -> None:
        def whole(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"config.world.{name}={v!r}: must be a whole number >= {low}")

        whole("entities", 1)
        whole("distractors", 0)
        whole("sentences_per_entity", 1)
        whole("shards", 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"config.world.seed={self.seed!r}: must be a whole number")
        if self.mention not in MENTIONS:
            raise ConfigError(
                f"config.world.mention={self.mention!r}: must be one of {', '.join(MENTIONS)}"
            )
        if self.names not in NAMES:
            raise ConfigError(
                f"config.world.names={self.names!r}: must be one of {', '.join(NAMES)}"
            )
        if self.shards > self.entities:
            raise ConfigError(
                f"config.world.shards={self.shards}: more shards than entities "
                f"({self.entities}) would leave a shard empty"
            )
        people = self.entities + self.distractors
        cap = min(len(CITIES) * len(PROFESSIONS), len(PROFESSIONS) * len(YEARS))
        cap = min(cap, len(CITIES) * len(YEARS))
        if people > cap:
            raise ConfigError(
                f"config.world: {people} people (entities + distractors) exceed the {cap} that "
                f"unique attribute pairs allow ({len(CITIES)} cities x {len(PROFESSIONS)} "
                "professions)"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Person:
    id: str
    name: str
    city: str
    year: int
    profession: str
    distractor: bool

    def value(self, attribute: str) -> str:
        return str(getattr(self, attribute))

    def fields(self) -> dict:
        """The template fields: name, the three attributes, `a` (the profession's article)."""
        a = "an" if self.profession[0] in "aeiou" else "a"
        job = DESCRIPTIONS[self.profession]  # (mention="described")
        return dict(
            name=self.name, city=self.city, year=self.year, profession=self.profession, a=a, job=job
        )


Sentence = tuple[str, list[tuple[int, int]]]  # (text, [(char start, char end)])


@dataclasses.dataclass
class World:
    settings: Settings
    people: list[Person]  # id order
    corpus: list[dict]  # {"id", "title", "text"}, in the corpus's (shuffled) order
    text: list[list[tuple[str, list[Sentence]]]]  # per shard: (title, sentences) per document
    questions: list[dict]  # qa.jsonl lines

    @property
    def entities(self) -> list[Person]:
        return [p for p in self.people if not p.distractor]


def _rng(seed: int, part: str) -> random.Random:
    """The random stream of one part of the world (a str seed is hashed: stable everywhere)."""
    return random.Random(f"realm-jax-world:{seed}:{part}")


@functools.lru_cache(maxsize=1)
def _vocab_words() -> frozenset[str]:
    with open(tk.VOCAB_PATH, encoding="utf-8") as f:
        return frozenset(w for w in (line.strip() for line in f) if w and w[0] not in "#[")


def _taken_words() -> tuple[str, ...]:
    return tuple(w.lower() for w in (*CITIES, *PROFESSIONS))


def _part(rng: random.Random, syllables: int, ending: bool) -> str:
    word = "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return (word + rng.choice(_ENDINGS) if ending else word).capitalize()


def _good_part(part: str) -> bool:
    """Not a word of the vocab, holds no city or profession, 4-12 letters, few wordpieces."""
    low = part.lower()
    if not 4 <= len(low) <= 12 or low in _vocab_words():
        return False
    if any(w in low for w in _taken_words()):
        return False
    (enc,) = tk.wordpieces([part])
    return len(enc.ids) <= _MAX_PART_PIECES


def _names(seed: int, n: int) -> list[str]:
    """n unique made-up full names; none is a prefix of another (so no name is found inside
    another's text)."""
    rng = _rng(seed, "names")
    names: list[str] = []
    lasts_of: dict[str, list[str]] = {}
    tries = 0
    while len(names) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise RuntimeError(f"could not make {n} distinct names")  # never seen: a bug
        first = _part(rng, 2, False)
        last = _part(rng, rng.choice((2, 3)), rng.random() < 0.5)
        if not (_good_part(first) and _good_part(last)):
            continue
        lasts = lasts_of.setdefault(first, [])
        if any(o.startswith(last) or last.startswith(o) for o in lasts):
            continue
        lasts.append(last)
        names.append(f"{first} {last}")
    return names


@functools.lru_cache(maxsize=1)
def _name_words() -> tuple[str, ...]:
    """The vocab's words fit for a "words" name: one wordpiece, alphabetic, 5-10 letters, none
    a city, profession or a word of the templates, in vocab order."""
    taken = set(_taken_words())
    for table in (KNOWLEDGE, TEXT_BY_NAME, TEXT_BY_ATTRIBUTES, TEXT_DESCRIBED, QUESTIONS):
        for templates in table.values():
            for t in templates if isinstance(templates, (list, tuple)) else (templates,):
                taken.update(w.lower() for w in re.findall(r"[A-Za-z]+", t))
    out = []
    with open(tk.VOCAB_PATH, encoding="utf-8") as f:
        for line in f:
            w = line.strip()
            if 5 <= len(w) <= 10 and w.isascii() and w.isalpha() and w not in taken:
                out.append(w)
    return tuple(out)


def _description_words() -> frozenset[str]:
    return frozenset(w for d in DESCRIPTIONS.values() for w in re.findall(r"[a-z]+", d))


def _word_names(seed: int, n: int, described: bool = False) -> list[str]:
    """n names of two vocab words each (config.world.names="words"): 2n distinct words drawn
    at random, so that no word is in two names. described: none a word of DESCRIPTIONS (left
    out only there, so the other worlds' names stay as they were drawn)."""
    words = _name_words()
    if described:
        words = tuple(w for w in words if w not in _description_words())
    if 2 * n > len(words):
        raise ConfigError(
            f"config.world: {n} people need {2 * n} name words; the vocab has {len(words)}"
        )
    drawn = _rng(seed, "word-names").sample(words, 2 * n)
    return [
        f"{a.capitalize()} {b.capitalize()}" for a, b in zip(drawn[::2], drawn[1::2], strict=True)
    ]


def _attributes(seed: int, n: int) -> list[tuple[str, int, str]]:
    """n (city, year, profession) triples, no pair of any two kinds shared by two of them:
    drawn uniformly among the free triples (a few random tries, then all free ones)."""
    rng = _rng(seed, "attributes")
    nc, np_, ny = len(CITIES), len(PROFESSIONS), len(YEARS)
    cp = np.zeros((nc, np_), bool)
    py = np.zeros((np_, ny), bool)
    cy = np.zeros((nc, ny), bool)
    out = []
    for i in range(n):
        for _ in range(64):
            c, p, y = rng.randrange(nc), rng.randrange(np_), rng.randrange(ny)
            if not (cp[c, p] or py[p, y] or cy[c, y]):
                break
        else:
            free = ~cp[:, :, None] & ~py[None, :, :] & ~cy[:, None, :]
            flat = np.flatnonzero(free)
            if not flat.size:
                raise ConfigError(
                    f"config.world: no free (city, profession, year) left for person {i + 1} "
                    f"of {n}: use fewer entities + distractors"
                )
            c, p, y = np.unravel_index(int(flat[rng.randrange(flat.size)]), free.shape)
            c, p, y = int(c), int(p), int(y)
        cp[c, p] = py[p, y] = cy[c, y] = True
        out.append((CITIES[c], YEARS[y], PROFESSIONS[p]))
    return out


def make_people(settings: Settings) -> list[Person]:
    """Every person (entities and distractors), in id order; the distractors drawn at random."""
    n = settings.entities + settings.distractors
    width = max(5, len(str(n - 1)))
    names = (
        _names(settings.seed, n)
        if settings.names == "made_up"
        else _word_names(settings.seed, n, settings.mention == "described")
    )
    attributes = _attributes(settings.seed, n)
    distractors = set(_rng(settings.seed, "roles").sample(range(n), settings.distractors))
    return [
        Person(f"person-{i:0{width}d}", name, city, year, profession, i in distractors)
        for i, (name, (city, year, profession)) in enumerate(zip(names, attributes, strict=True))
    ]


def _render(template: str, person: Person, attribute: str) -> Sentence:
    """The sentence and the character span of `attribute`'s value in it (its one mention)."""
    fields = person.fields()
    head, tail = template.split("{" + attribute + "}")
    head, value, tail = head.format(**fields), person.value(attribute), tail.format(**fields)
    sentence = head + value + tail
    mentions = re.findall(rf"\b{re.escape(value)}\b", sentence, flags=re.IGNORECASE)
    if len(mentions) != 1:  # the masked value must not show elsewhere (a template bug)
        raise AssertionError(f"{sentence!r} mentions {value!r} {len(mentions)} times")
    return sentence, [(len(head), len(head) + len(value))]


def _knowledge_document(rng: random.Random, person: Person) -> dict:
    order = rng.sample(ATTRIBUTES, len(ATTRIBUTES))
    sentences = [_render(rng.choice(KNOWLEDGE[a]), person, a)[0] for a in order]
    return {"id": person.id, "title": person.name, "text": " ".join(sentences)}


def _text_document(rng: random.Random, person: Person, settings: Settings) -> list[Sentence]:
    """sentences_per_entity sentences cycling through the attributes (from a drawn first);
    each attribute's templates in a drawn order, so a repeated attribute is restated anew."""
    templates = {
        "name": TEXT_BY_NAME,
        "attributes": TEXT_BY_ATTRIBUTES,
        "described": TEXT_DESCRIBED,
    }[settings.mention]
    order = rng.sample(ATTRIBUTES, len(ATTRIBUTES))
    drawn = {a: rng.sample(templates[a], len(templates[a])) for a in ATTRIBUTES}
    out = []
    for k in range(settings.sentences_per_entity):
        a = order[k % len(order)]
        options = drawn[a]
        out.append(_render(options[(k // len(order)) % len(options)], person, a))
    return out


def _questions(rng: random.Random, person: Person) -> list[dict]:
    return [
        {
            "question": rng.choice(QUESTIONS[a]).format(**person.fields()),
            "answers": [person.value(a)],
            "gold_passage": person.id,
            "title": person.name,
            "id": f"{person.id}/{a}",
        }
        for a in ATTRIBUTES
    ]


def generate(settings: Settings) -> World:
    """The whole world in memory (what write_world writes)."""
    people = make_people(settings)
    rng = _rng(settings.seed, "corpus")
    corpus = [_knowledge_document(rng, p) for p in people]
    _rng(settings.seed, "corpus-order").shuffle(corpus)
    rng = _rng(settings.seed, "text")
    entities = [p for p in people if not p.distractor]
    docs = [(p.name, _text_document(rng, p, settings)) for p in entities]
    rng.shuffle(docs)
    bounds = np.linspace(0, len(docs), settings.shards + 1).round().astype(int)
    text = [docs[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    rng = _rng(settings.seed, "qa")
    questions = [q for p in entities for q in _questions(rng, p)]
    return World(settings, people, corpus, text, questions)


def shard_names(shards: int) -> list[str]:
    """The text's shard files, relative to the workdir."""
    return [f"{TEXT_DIR}/world-{i:05d}-of-{shards:05d}.tfrecord.gz" for i in range(shards)]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def wordpiece_lengths(world: World) -> dict[str, int]:
    """The longest knowledge document as a block ([CLS] title [SEP] body [SEP]) and the longest
    text sentence as a query ([CLS] sentence [SEP]), in wordpieces."""
    docs = world.corpus
    encs = tk.wordpieces([d["title"] for d in docs] + [d["text"] for d in docs])
    titles, bodies = encs[: len(docs)], encs[len(docs) :]
    block = max(3 + len(t.ids) + len(b.ids) for t, b in zip(titles, bodies, strict=True))
    sentences = [s for shard in world.text for _, sents in shard for s, _ in sents]
    query = max(2 + len(e.ids) for e in tk.wordpieces(sentences))
    return {"longest_document_block": block, "longest_sentence_query": query}


def _manifest(world: World, complete: bool, extra: dict | None = None) -> dict:
    s = world.settings
    entities = len(world.entities)
    sentences = entities * s.sentences_per_entity
    return {
        "format_version": FORMAT_VERSION,
        "generator": "realm-jax world",
        "world": s.to_dict(),
        "complete": complete,
        "counts": {
            "people": len(world.people),
            "entities": entities,
            "distractors": len(world.people) - entities,
            "corpus_documents": len(world.corpus),
            "text_documents": entities,
            "text_sentences": sentences,
            "text_spans": sentences,
            "questions": len(world.questions),
        },
        "files": {
            "corpus": CORPUS,
            "text": shard_names(s.shards),
            "qa": QA,
            "people": PEOPLE,
        },
        "vocabulary": {
            "cities": len(CITIES),
            "professions": len(PROFESSIONS),
            "years": f"{YEARS[0]}-{YEARS[-1]}",
        },
        **(extra or {}),
    }


def _dump(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode("utf-8")


def check_workdir(workdir: str, settings: Settings) -> None:
    """Refuse a folder holding a world of other config.world values, or world files without a
    manifest; the same values may be written again."""
    path = fs.join(workdir, MANIFEST)
    if fs.exists(path):
        try:
            old = json.loads(fs.read_bytes(path))
            old_world, old_version = old["world"], old["format_version"]
        except (ValueError, KeyError, TypeError):
            raise WorldError(
                f"{path} is not a world manifest: refusing to write a world into {workdir}; "
                "use a new --workdir"
            ) from None
        new = settings.to_dict()
        if old_version != FORMAT_VERSION or old_world != new:
            diff = ", ".join(
                f"{k}={old_world.get(k)!r} (now {v!r})"
                for k, v in new.items()
                if isinstance(old_world, dict) and old_world.get(k) != v
            )
            raise WorldError(
                f"{workdir} holds a different world ({diff or f'format {old_version}'}); "
                "write this one into a new --workdir, or delete the old one first"
            )
    else:
        found = [n for n in (CORPUS, QA, PEOPLE, TEXT_DIR) if fs.exists(fs.join(workdir, n))]
        if found:
            raise WorldError(
                f"{workdir} holds {', '.join(found)} but no {MANIFEST} (not written by "
                "`realm-jax world`): refusing to overwrite; use a new --workdir"
            )
    text = fs.join(workdir, TEXT_DIR)
    if fs.isdir(text):
        ours = {n.split("/", 1)[1] for n in shard_names(settings.shards)}
        other = [n for n in fs.walk_files(text) if n not in ours]
        if other:
            raise WorldError(
                f"{text} holds files this world does not write ({', '.join(other[:3])}"
                f"{', ...' if len(other) > 3 else ''}): prepare would read them as text too; "
                "use a new --workdir"
            )


def write_world(workdir: str, settings: Settings) -> dict:
    """Generate the world and write it into `workdir`; returns the manifest written."""
    t0 = time.time()
    check_workdir(workdir, settings)
    log.info(
        "generating a world of %d entities + %d distractors (seed %d, mention=%s)",
        settings.entities,
        settings.distractors,
        settings.seed,
        settings.mention,
    )
    world = generate(settings)
    fs.makedirs(fs.join(workdir, TEXT_DIR))
    fs.write_bytes(fs.join(workdir, MANIFEST), _dump(_manifest(world, complete=False)))
    digests = {}

    def put(rel: str, data: bytes) -> None:
        fs.write_bytes(fs.join(workdir, *rel.split("/")), data)
        digests[rel] = hashlib.sha256(data).hexdigest()

    put(PEOPLE, _jsonl([dataclasses.asdict(p) for p in world.people]))
    put(CORPUS, _jsonl(world.corpus))
    log.info("wrote %s: %d knowledge documents", CORPUS, len(world.corpus))
    for rel, docs in zip(shard_names(settings.shards), world.text, strict=True):
        path = fs.join(workdir, *rel.split("/"))
        realm_records.write_documents(path, docs)
        digests[rel] = hashlib.sha256(fs.read_bytes(path)).hexdigest()
        log.info("wrote %s: %d documents", rel, len(docs))
    put(QA, _jsonl(world.questions))
    log.info("wrote %s: %d questions", QA, len(world.questions))
    lengths = wordpiece_lengths(world)
    manifest = _manifest(world, True, {"wordpieces": lengths, "sha256": digests})
    fs.write_bytes(fs.join(workdir, MANIFEST), _dump(manifest))
    log.info("wrote %s in %.1fs", MANIFEST, time.time() - t0)
    return manifest


def _summary(config, args, manifest: dict) -> str:
    workdir = args.workdir.rstrip("/") or args.workdir
    s, c, wp = manifest["world"], manifest["counts"], manifest["wordpieces"]
    data = config.get("data", {})
    block_len, query_len = data.get("block_len", 64), data.get("query_len", 32)
    lines = [
        f"world: {c['entities']} people in the text + {c['distractors']} distractors "
        f"(seed {s['seed']}, mention={s['mention']}) -> {workdir}",
        f"  {CORPUS:<14}{c['corpus_documents']:>7} knowledge documents (longest "
        f"{wp['longest_document_block']} wordpieces as a block; data.block_len {block_len})",
        f"  {TEXT_DIR + '/':<14}{c['text_documents']:>7} documents in {s['shards']} shard(s): "
        f"{c['text_sentences']} sentences, one annotated span each",
        f"  {'':<14}{'':>7} (longest {wp['longest_sentence_query']} wordpieces as a query; "
        f"data.query_len {query_len})",
        f"  {QA:<14}{c['questions']:>7} questions (SQuAD-style, gold_passage = corpus id)",
        f"  {PEOPLE:<14}{c['people']:>7} people (the attribute table)",
        f"  {MANIFEST:<14}{'':>7} the manifest",
    ]
    overrides = ""
    corpus, text = fs.join(workdir, CORPUS), fs.join(workdir, TEXT_DIR)
    if fs.abspath(str(data.get("corpus", ""))) != fs.abspath(corpus) or fs.abspath(
        str(data.get("sentences", "")).rstrip("/")
    ) != fs.abspath(text):
        overrides = (
            f" --config.data.corpus={corpus} --config.data.sentences={text} "
            f"--config.data.data_dir={workdir}-data"
        )
    run = f"{workdir}-realm"
    train = "local" if config.get("refresh", {}).get("mode", "external") == "external" else "train"
    lines += [
        "next:",
        f"  python -m realm_jax prepare --config {args.config} --workdir {run}{overrides}",
        f"  python -m realm_jax {train} --config {args.config} --workdir {run}{overrides}",
    ]
    return "\n".join(lines)


def command(config, args) -> int:
    """`realm-jax world`: write config.world's world into --workdir."""
    settings = Settings.from_config(config)
    manifest = write_world(args.workdir, settings)
    wp = manifest["wordpieces"]
    data = config.get("data", {})
    if wp["longest_document_block"] > data.get("block_len", 64):
        log.warning(
            "a knowledge document takes %d wordpieces, more than data.block_len %d: it will "
            "span two blocks",
            wp["longest_document_block"],
            data.get("block_len", 64),
        )
    print(_summary(config, args, manifest))
    return 0
