"""What the REALM train step is compiled with: one frozen, hashable StepConfig, built once from
the run's config where the step is compiled (StepConfig.from_config) and passed as one argument.

Every field names the config field it comes from; the experimental loss terms it turns on are
`terms`, by name (pretrain/terms.py), so the step's core never asks which switch is set."""

from __future__ import annotations

import dataclasses

from realm_jax.model.inputs import joint_len

NULL_DOCS = ("scored", "fixed")  # train.null_doc


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The train step's settings. num_valid is the index's, not the config's."""

    num_candidates: int  # train.num_candidates: K, the null document included
    num_valid: int  # the index's real rows (the rest is padding): its num_blocks
    length: int  # data.query_len + data.block_len - 1: the reader's joint input (joint_len)
    vocab_chunk: int = 0  # train.mlm_vocab_chunk: 0 whole vocabulary, -1 materialised logits
    seed: int = 0  # train.seed: dropout keys are fold_in(key(seed), step)
    grad_accum: int = 1  # train.grad_accum: micro-batches a step's batch is split into
    fixed_null: bool = False  # train.null_doc == "fixed": the null document's prior 1/K
    retriever_grad: bool = True  # train.realm_retriever_grad: False stops REALM's at the scores
    own_block_steps: int = 0  # train.own_block_steps: the copying curriculum's steps
    article_block_steps: int = 0  # train.article_block_steps: its article-block variant's
    inbatch_negatives: bool = False  # train.inbatch_negatives: the prior over the batch's blocks
    imitation_weight: float = 0.0  # train.imitation_weight: the BM25-imitation term's weight
    imitation_negatives: str = "candidates"  # train.imitation_negatives: its columns
    # the frozen-embedders variant (steps before train.embedders_frozen_steps; not from the
    # config: compile_train_step(frozen=True)): the reader's gradient alone (step.train_step)
    embedders_frozen: bool = False

    @classmethod
    def from_config(cls, config, num_valid: int) -> StepConfig:
        """The step's settings from the run's config (a field the config lacks: the default
        above, the release's behaviour) and the index's real rows."""
        t = config.train
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}

        def get(name, key=None):
            return type(defaults[name])(t.get(key or name, defaults[name]))

        return cls(
            num_candidates=int(t.num_candidates),
            num_valid=int(num_valid),
            length=joint_len(config),
            vocab_chunk=int(t.mlm_vocab_chunk),
            seed=int(t.seed),
            grad_accum=get("grad_accum"),
            fixed_null=fixed_null(config),
            retriever_grad=get("retriever_grad", "realm_retriever_grad"),
            own_block_steps=get("own_block_steps"),
            article_block_steps=get("article_block_steps"),
            inbatch_negatives=get("inbatch_negatives"),
            imitation_weight=get("imitation_weight"),
            imitation_negatives=get("imitation_negatives"),
        )

    @property
    def terms(self) -> tuple[str, ...]:
        """The experimental loss terms on, by name (terms.TERMS): "curriculum" (own_block_steps,
        article_block_steps), "inbatch" (inbatch_negatives), "imitation" (imitation_weight)."""
        on = {
            "curriculum": self.own_block_steps > 0 or self.article_block_steps > 0,
            "inbatch": self.inbatch_negatives,
            "imitation": self.imitation_weight > 0,
        }
        return tuple(name for name, is_on in on.items() if is_on)

    def without_terms(self) -> StepConfig:
        """REALM's loss alone, every experimental term off (compile_loss: evaluation, tests)."""
        return dataclasses.replace(
            self,
            own_block_steps=0,
            article_block_steps=0,
            inbatch_negatives=False,
            imitation_weight=0.0,
            retriever_grad=True,
        )


def fixed_null(config) -> bool:
    """train.null_doc: "scored" (the release: the empty block embedded and scored like any
    block) or "fixed" (its prior 1/K for every query: retrieval.retrieve_embedded)."""
    mode = config.train.get("null_doc", "scored")
    if mode not in NULL_DOCS:
        from realm_jax.config import ConfigError

        raise ConfigError(f"train.null_doc={mode!r}: must be one of {', '.join(NULL_DOCS)}")
    return mode == "fixed"
