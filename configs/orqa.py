"""Open-domain QA fine-tuning configs (ORQA, Lee et al. 2019, as REALM fine-tunes).

Same sections as configs/realm.py (the blocks are the same prepared corpus, the networks the
same), plus `qa`. Run `python -m realm_jax finetune --config configs/orqa.py:<variant>` after
`prepare` (and usually after pre-training: model.init_from_realm), then `evaluate` and `ask`.

Variants: smoke (the bundled sample: its QA file, split by the sample's held-out article),
small, base (ORQA's: retriever beam 5000, reader beam 5, reader length 320, lr 1e-5, BERT-base;
questions from NQ-open files that `qa.train_file`/`qa.dev_file` must name), world (the generated
world's questions, runs/world/qa.jsonl, split by the prepared world's held-out people,
fine-tuned from the tutorial's REALM run runs/world-realm; docs/tutorial.md), squad (the QA
reference result in experiments/squad_qa: SQuAD questions split by held-out article, fine-tuned
from the squad pre-training recipe's REALM workdir), squad_read (a reading-comprehension
phase for bert-tiny's reader on the training articles' gold passages, before pre-training and
fine-tuning: a deviation from REALM and ORQA, whose BERT-base reader needs none; issue 22),
own_read (the own-corpus recipe's default, README "On your own corpus": the reading phase on
your corpus and your questions, which `qa.train_file`/`qa.dev_file` must name, all-MiniLM-L6-v2
retrieving, frozen; no pre-training run needed), own (the recipe's adaptation path: squad's
settings on your corpus and questions, fine-tuned from your REALM run of configs/realm.py:own,
`model.init_from_realm` (no default: without it, or a `model.init_reader_from`, the reader would
start from random weights, an error)); own and own_read's `evaluate` and `ask` answer with the
hybrid retriever, `qa.retriever`.
"""

import ml_collections

from realm_jax import config as config_lib

# train.* fields taken from configs/realm.py's variant on purpose (tests/test_configs.py fails
# on any other inherited train field): the same AdamW and loop settings as pre-training.
INHERITED = config_lib.SHARED_TRAIN_FIELDS


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke"
    # squad's (own's) settings, then the reading phase's (below)
    read = variant in ("squad_read", "own_read")
    # configs/realm.py's variant (an unknown variant is rejected there)
    sibling = {"squad_read": "squad", "own_read": "own"}.get(variant, variant)
    c = config_lib.sibling_config(__file__, "realm.py", sibling)
    c.variant = variant
    c.task = "qa"  # what `train` runs (the same as `finetune`)
    q = c.qa = ml_collections.ConfigDict()
    sample = variant == "smoke"
    squad = variant in ("squad", "squad_read")
    own = variant in ("own", "own_read")  # squad's recipe on the user's corpus and questions
    world = variant == "world"
    variant = "squad" if (read or own) else variant  # own: squad's numbers below
    qa_file = {
        "smoke": "data/sample/qa.jsonl",
        "squad": config_lib.squad_files()[1],  # the corpus's own questions (configs/realm.py)
        "world": "runs/world/qa.jsonl",  # `realm-jax world --workdir runs/world`
    }.get(variant, "")
    qa_file = "" if own else qa_file  # own: yours (--config.qa.train_file=... qa.dev_file=...)
    q.train_file = qa_file  # questions to fine-tune on (see `evaluate --help` for formats)
    q.dev_file = qa_file  # questions of the periodic evaluation and `evaluate`'s default
    q.format = "auto"  # auto, nq, squad, squad_json, webquestions, curatedtrec
    # SQuAD-style files with titles split by the prepared data's held-out articles: fine-tune
    # on the others, evaluate on the held-out ones ("none": use every question of the file).
    split = sample or squad or world or own
    q.train_holdout = "train" if split else "none"
    q.dev_holdout = "heldout" if split else "none"
    # ORQA: 5000 (of 13M blocks); the world has 1,000
    q.retriever_beam_size = {"smoke": 16, "squad": 100, "world": 100}.get(variant, 5000)
    q.reader_beam_size = 3 if sample else 5  # blocks read per question (ORQA: 5)
    q.eval_reader_beam_size = 0  # blocks evaluate and ask read; 0 = qa.reader_beam_size
    q.reader_len = {"base": 320}.get(variant, 0)  # reader input length; 0 = query + block - 1
    q.answer_len = 16  # longest answer (wordpieces) looked for in blocks
    q.max_answers = 8  # answers per question looked for in blocks
    q.recall_ks = (1, 5, 10, 20)  # recall@k of answer-containing blocks
    # Reading BM25's blocks (`evaluate --retriever bm25`): the retrieval score added to each
    # span score is BM25's score x this weight (ORQA adds its retriever's logit; BM25 is not in
    # the release: BERTserini-style interpolation); 0 = the span scores alone. 1.0: chosen on
    # the 500 dev questions for the reading phase's reader (experiments/bm25_reader: held-out
    # EM on BM25's top 5, 5.1% with the span scores alone -> 10.4%).
    q.bm25_weight = 1.0
    # `--retriever hybrid` (DPR's hybrid, not in the release): the union of the dense and BM25
    # top hybrid_pool blocks (DPR: 2000 each), every block rescored exactly as its dense
    # relevance + hybrid_bm25_weight x its BM25 score; the reader then adds that score to each
    # span score. (DPR weighs the dense side: BM25 + 1.1 x sim; the weight here is BM25's.)
    q.hybrid_pool = 100  # blocks each retriever contributes to the union
    # squad: 4, chosen on 1,000 training-article questions with the ICT retriever (zero-shot
    # recall@5 / @20: weight 0.5 67.6 / 79.7, 1 77.5 / 87.4, 2 81.3 / 89.9, 4 82.4 / 90.6,
    # 8 82.0 / 90.3; BM25 alone 80.1 / 89.5): experiments/second_retriever/README.md
    # (own: the same 4, with which experiments/trusted_start scores MiniLM's hybrid)
    q.hybrid_bm25_weight = 4.0 if (squad or own) else 1.0  # BM25's weight in the hybrid score
    # the retriever `evaluate` and `ask` (and realm_jax.load's answer and retrieve) use when
    # not told (--retriever): own answers with the hybrid, which was at or above BM25 on every
    # SQuAD figure (docs/recipe.md); the others with the fine-tuned dense retriever (ORQA's)
    q.retriever = "hybrid" if own else "dense"  # dense, bm25 or hybrid
    # the retriever of finetune's periodic dev evaluation (and so of the best checkpoint kept):
    # dense (ORQA's), bm25 or hybrid; training itself reads the dense top blocks (ORQA's loss)
    q.dev_retriever = "dense"  # dense, bm25 or hybrid (above)
    q.best_metric = "exact_match"  # dev metric whose best checkpoint is kept (<workdir>/best)
    # A deviation from ORQA, which has no gold passages (REALM and ORQA fine-tune on NQ): when a
    # question's gold block (the answer-holding block of its SQuAD gold_passage) is not among
    # the top reader_beam_size retrieved, it replaces the last one read (its retrieval logit
    # from the frozen index, the retriever loss unchanged), so the small reader gets a
    # supervised read on every question instead of the ~30% whose answer the dense top R
    # happens to hold (issue 22). Questions without a gold passage (NQ files) are unaffected.
    q.gold_in_beam = squad or own
    # Fine-tuning that refreshes (issue 61; RAG-end2end's setting, not ORQA's, whose document
    # embedder stays frozen): the document embedder trains too, through the retrieval scores
    # of the reader_beam_size blocks read (re-embedded in the step from their tokens; the rest
    # of the retriever beam keeps the index's scores), and the whole index is re-embedded and
    # published every refresh_every steps (0: never; evaluate reads the newest version at or
    # before its checkpoint's step).
    q.train_doc_embedder = False
    q.refresh_every = 100
    # the frozen index `finetune` publishes once serves `ask` and `evaluate` on the host
    c.refresh.build_scann = True  # with a ScaNN searcher (configs/realm.py: off for pre-training)

    m = c.model
    m.init_embedders_from_ict = ""
    if squad or world or own:  # the pre-training recipe's REALM run: all three networks
        m.init_embedder_from = m.init_reader_from = ""
        m.init_from_realm = {"world": "runs/world-realm", "own": ""}.get(c.variant, "runs/squad")
    # (the world's ICT-only baseline, ORQA's start: --config.model.init_from_realm=
    # --config.model.init_embedders_from_ict=runs/world-ict
    # --config.model.init_reader_from=google/bert_uncased_L-2_H-128_A-2)
    t = c.train
    t.batch_size = {"smoke": 8, "squad": 16, "world": 16, "base": 64}.get(variant, 32)  # questions
    # per step; the world: 1,200 training questions (400 people x 3), 4 epochs
    t.steps = {"smoke": 40, "squad": 1000, "world": 300, "base": 20_000}.get(variant, 2000)
    # ORQA: 1e-5 for BERT-base. bert-tiny's reader learns fastest near 1e-3 (experiments/ablations
    # "A reader that reads": 2e-4, 1e-3, 3e-3 measured), where its query embedder would lose
    # its retrieval (3e-3: no answer left in the retriever's beam): that one stays at 2e-4.
    t.lr = {"smoke": 1e-3, "squad": 1e-3, "world": 1e-3, "base": 1e-5}.get(variant, 3e-5)
    t.warmup_steps = {"smoke": 4, "squad": 100, "world": 20}.get(variant, -1)
    # the query embedder's LR relative to the reader's (the world: as its pre-training, where
    # the embedders lost their retrieval at the reader's LR)
    t.embedder_lr_scale = {"squad": 0.2, "world": 0.1}.get(variant, 1.0)
    t.embedders_frozen_steps = 0  # the query embedder trains from the first step, as in ORQA
    t.embedders_warmup_steps = 0  # (no late start)
    t.frozen_step = False  # (no frozen steps: REALM's reader-only step unused)
    t.own_block_steps = 0  # (REALM pre-training only)
    t.log_every = 10 if variant != "base" else 100
    t.checkpoint_every = {"smoke": 20, "squad": 500, "world": 100}.get(variant, 1000)
    t.eval_every = {"smoke": 20, "squad": 500, "world": 100}.get(variant, 1000)
    t.eval_batch_size = {"smoke": 8, "squad": 32, "world": 32}.get(variant, 64)
    # dev questions; 0 = all (the world: its 300 held-out people's questions)
    t.eval_examples = {"smoke": 64, "squad": 500}.get(variant, 0)
    if read:
        _reading_phase(c)
    return c


def _reading_phase(c: ml_collections.ConfigDict) -> None:
    """squad_read: bert-tiny's reader reads the gold passages of the training articles' SQuAD
    questions (never a held-out article's), one block a question, many questions a step, the
    span head trained with it; the retriever takes no step. REALM pre-training and ORQA
    fine-tuning then start from this reader (model.init_from_realm=<this workdir> with
    model.init_span_head_from_realm=true). A deviation from the paper, which starts from
    BERT-base: bert-tiny fine-tuned by ORQA alone read 6% of held-out questions right given
    their gold passage (experiments/ablations), too weak a reader to tell the arms apart.

    own_read: the same phase on the user's corpus and questions, the embedders all-MiniLM-L6-v2's
    (frozen: embedder_lr_scale 0), answering with the hybrid retriever; its workdir is the
    own-corpus recipe's QA model (README "On your own corpus"): on SQuAD's held-out questions
    this reader with MiniLM zero-shot read 12.2% of them right from the hybrid's top 5, against
    11.4% from BM25's (experiments/trusted_start "exact match"). A question without a gold
    passage (NQ-open files) reads the dense retriever's top block instead, learning where an
    answer's wordpieces occur in it (ORQA's distant supervision with one block)."""
    m, q, t = c.model, c.qa, c.train
    m.init_from_realm = ""
    m.init_reader_from = config_lib.BERT_TINY  # the reader REALM starts from
    # the embedders (bert-tiny's, frozen; own_read: all-MiniLM-L6-v2's, model.init_retriever_from
    # of configs/realm.py:own) only pick the read block when it is the gold one: this phase
    # needs no ICT run before it
    m.init_embedders_from_ict = ""
    q.reader_beam_size = 1  # the gold block (gold_in_beam), or the top block when it is gold
    # own_read's workdir answers: it reads the top 5 (squad's reader_beam_size), as the
    # exact match of experiments/trusted_start read them
    q.eval_reader_beam_size = 5 if c.variant == "own_read" else 0
    t.embedder_lr_scale = 0.0  # the reader alone learns
    t.batch_size = 64  # questions a step: 64 gold reads
    # ~154k reads, about two epochs of the training articles' questions. Held-out EM given the
    # gold passage: 14.0% after one epoch (1,200 steps), 15.6% after two (experiments/ablations "A
    # reader that reads: two epochs")
    t.steps = 2400
    t.warmup_steps = 100
    t.eval_every = 0  # the periodic evaluation reads dense retrieval; score with
    t.checkpoint_every = 400  # `evaluate --retriever gold` (own_read: its qa.retriever) instead


def sweep():
    """Fine-tuning LR x the reader's beam (blocks read per question; ORQA: 5), as dicts."""
    return [{"train.lr": lr, "qa.reader_beam_size": k} for lr in (1e-5, 3e-5) for k in (3, 5)]
