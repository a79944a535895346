"""Open-domain QA fine-tuning configs (ORQA, Lee et al. 2019, as REALM fine-tunes).

Same sections as configs/realm.py (the blocks are the same prepared corpus, the networks the
same), plus `qa`. Run `python -m realm_jax finetune --config configs/orqa.py:<variant>` after
`prepare` (and usually after pre-training: model.init_from_realm), then `evaluate` and `ask`.

Variants: smoke (the bundled sample: its QA file, split by the sample's held-out article),
small, base (ORQA's: retriever beam 5000, reader beam 5, reader length 320, lr 1e-5, BERT-base;
questions from NQ-open files that `qa.train_file`/`qa.dev_file` must name), squad (the QA
reference result in docs/results.md: SQuAD questions split by held-out article, fine-tuned
from the squad pre-training recipe's REALM workdir).
"""

import ml_collections

from realm_jax import config as config_lib

# train.* fields taken from configs/realm.py's variant on purpose (tests/test_configs.py fails
# on any other inherited train field): the same AdamW and loop settings as pre-training.
INHERITED = config_lib.SHARED_TRAIN_FIELDS


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke"
    # configs/realm.py's variant (an unknown variant is rejected there)
    c = config_lib.sibling_config(__file__, "realm.py", variant)
    c.task = "qa"  # what `train` runs (the same as `finetune`)
    q = c.qa = ml_collections.ConfigDict()
    sample = variant == "smoke"
    squad = variant == "squad"
    qa_file = {
        "smoke": "data/sample/qa.jsonl",
        "squad": "../shared/data/squad/qa_train.jsonl",
    }.get(variant, "")
    q.train_file = qa_file  # questions to fine-tune on (see `evaluate --help` for formats)
    q.dev_file = qa_file  # questions of the periodic evaluation and `evaluate`'s default
    q.format = "auto"  # auto, nq, squad, webquestions, curatedtrec
    # SQuAD-style files with titles split by the prepared data's held-out articles: fine-tune
    # on the others, evaluate on the held-out ones ("none": use every question of the file).
    q.train_holdout = "train" if (sample or squad) else "none"
    q.dev_holdout = "heldout" if (sample or squad) else "none"
    q.retriever_beam_size = {"smoke": 16, "squad": 100}.get(variant, 5000)  # ORQA: 5000
    q.reader_beam_size = 3 if sample else 5  # blocks read per question (ORQA: 5)
    q.reader_len = {"base": 320}.get(variant, 0)  # reader input length; 0 = query + block - 1
    q.answer_len = 16  # longest answer (wordpieces) looked for in blocks
    q.max_answers = 8  # answers per question looked for in blocks
    q.recall_ks = (1, 5, 10, 20)  # recall@k of answer-containing blocks
    q.best_metric = "exact_match"  # dev metric whose best checkpoint is kept (<workdir>/best)
    # A deviation from ORQA, which has no gold passages (REALM and ORQA fine-tune on NQ): when a
    # question's gold block (the answer-holding block of its SQuAD gold_passage) is not among
    # the top reader_beam_size retrieved, it replaces the last one read (its retrieval logit
    # from the frozen index, the retriever loss unchanged), so the small reader gets a
    # supervised read on every question instead of the ~30% whose answer the dense top R
    # happens to hold (issue 22). Questions without a gold passage (NQ files) are unaffected.
    q.gold_in_beam = squad

    m = c.model
    m.init_embedders_from_ict = ""
    if squad:  # ORQA's 256 is a third of BERT-base's width; bert-tiny is 128 wide, and the
        m.span_hidden_size = 64  # [spans, width] activations dominated the step at 256
    if squad:  # the pre-training recipe's REALM run: all three networks
        m.init_embedder_from = m.init_reader_from = ""
        m.init_from_realm = "runs/squad"
    t = c.train
    t.batch_size = {"smoke": 8, "squad": 16, "base": 64}.get(variant, 32)  # questions per step
    t.steps = {"smoke": 40, "squad": 1000, "base": 20_000}.get(variant, 2000)
    # ORQA: 1e-5 for BERT-base. bert-tiny's span head starts from scratch: squad measured in
    # docs/results.md.
    t.lr = {"smoke": 1e-3, "squad": 2e-4, "base": 1e-5}.get(variant, 3e-5)
    t.warmup_steps = {"smoke": 4, "squad": 100}.get(variant, -1)
    t.embedder_lr_scale = 1.0  # the query embedder's LR relative to the reader's
    t.log_every = 10 if variant != "base" else 100
    t.checkpoint_every = {"smoke": 20, "squad": 500}.get(variant, 1000)
    t.eval_every = {"smoke": 20, "squad": 500}.get(variant, 1000)
    t.eval_batch_size = {"smoke": 8, "squad": 32}.get(variant, 64)
    t.eval_examples = {"smoke": 64, "squad": 500}.get(variant, 0)  # dev questions; 0 = all
    return c


def sweep():
    """Fine-tuning LR x the reader's beam (blocks read per question; ORQA: 5), as dicts."""
    return [{"train.lr": lr, "qa.reader_beam_size": k} for lr in (1e-5, 3e-5) for k in (3, 5)]
