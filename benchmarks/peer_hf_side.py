"""The HuggingFace side of benchmarks/peer_hf_realm.py: REALM in PyTorch, run in `.venv-peer`.

    .venv-peer/bin/python benchmarks/peer_hf_side.py --task train|embed --inputs FILE.npz \
        --threads N --reps R [--batch B]

Never imports realm_jax or jax (its venv has neither). Builds transformers' deprecated REALM
networks from a RealmConfig with random weights (no hub), times the task on the inputs the
driver wrote, and prints one line `RESULT {json}`: the timed seconds, the warm-up, and the
process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

# No model hub here: everything is built from a config, and nothing may try the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEP_ID = 102
IGNORE = -100  # CrossEntropyLoss's ignore index: HF's label for "not a masked position"


def pin_threads(n: int) -> None:
    """Pin this process to its first n cores, as the JAX side does: the same thread count."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def timed(call, reps: int) -> dict:
    """call() once as warm-up (compile / first call), then reps timed calls: {"warmup_s",
    "times", "first": the warm-up call's result}. Both sides of the benchmark time this way."""
    t0 = time.perf_counter()
    first = call()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {"warmup_s": warmup_s, "times": times, "first": first}


def segments(tokens):
    """[..., L] block ids -> segment ids: 0 up to and including the title's [SEP], 1 after
    it, 0 on padding (the rule realm-jax's document embedder uses)."""
    import numpy as np

    is_sep = tokens == SEP_ID
    seg = (np.cumsum(is_sep, axis=-1) - is_sep) >= 1
    return np.where(tokens != 0, seg, False).astype(np.int64)


def realm_config(a: dict):
    """RealmConfig at the driver's sizes; dropout in every place BERT has it."""
    from transformers.models.deprecated.realm import RealmConfig

    return RealmConfig(
        vocab_size=a["vocab_size"],
        hidden_size=a["hidden_size"],
        num_hidden_layers=a["num_layers"],
        num_attention_heads=a["num_heads"],
        intermediate_size=a["intermediate_size"],
        retriever_proj_size=a["proj_size"],
        num_candidates=a["num_candidates"],
        hidden_dropout_prob=a["dropout"],
        attention_probs_dropout_prob=a["dropout"],
        hidden_act="gelu_new",
    )


def joint_inputs(query, blocks, length: int):
    """HF's reader input for every (query, candidate): [CLS] query [SEP] block-without-[CLS],
    zero-padded to `length`. query [B, Lq] (no padding), blocks [B, K, Lb] ->
    (ids, token types, mask), each [B, K, length]."""
    import numpy as np

    B, K, Lb = blocks.shape
    Lq = query.shape[1]
    ids = np.zeros((B, K, length), np.int64)
    ids[:, :, :Lq] = query[:, None]
    body = blocks[:, :, 1 : 1 + length - Lq]
    ids[:, :, Lq : Lq + body.shape[2]] = body
    types = np.zeros_like(ids)
    types[:, :, Lq:] = 1
    mask = (ids != 0).astype(np.int64)
    return ids, types * mask, mask


def train_inputs(data, a: dict):
    """Tensors for one REALM pre-training step: the query, its K candidate blocks from the
    driver's table, the joint reader input, and labels/mlm_mask at the masked positions."""
    import numpy as np
    import torch

    q = data["query_ids"].astype(np.int64)  # [B, Lq]
    B = q.shape[0]
    cands = data["blocks"][data["hf_candidates"]].astype(np.int64)  # [B, K, Lb]
    j_ids, j_types, j_mask = joint_inputs(q, cands, a["joint_len"])
    labels = np.full((B, a["joint_len"]), IGNORE, np.int64)
    mlm_mask = np.zeros((B, a["joint_len"]), np.int64)
    rows = np.arange(B)[:, None]
    labels[rows, data["mlm_positions"]] = data["mlm_targets"]
    mlm_mask[rows, data["mlm_positions"]] = 1
    t = torch.from_numpy
    return dict(
        query=dict(
            input_ids=t(q),
            attention_mask=t((q != 0).astype(np.int64)),
            token_type_ids=torch.zeros_like(t(q)),
            candidate_input_ids=t(cands),
            candidate_attention_mask=t((cands != 0).astype(np.int64)),
            candidate_token_type_ids=t(segments(cands)),
        ),
        reader=dict(
            input_ids=t(j_ids),
            attention_mask=t(j_mask),
            token_type_ids=t(j_types),
            labels=t(labels),
            mlm_mask=t(mlm_mask),
        ),
    )


def adamw_groups(modules, weight_decay: float):
    """Parameter groups as BERT's (and realm-jax's) AdamW: no decay on LayerNorm or biases."""
    decay, no_decay = [], []
    for m in modules:
        for name, p in m.named_parameters():
            (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def run_train(data, a: dict, reps: int) -> dict:
    """Forward (scorer over K candidates, reader with the marginal MLM loss), backward,
    global-norm clipping and an AdamW update, timed reps times after one warm-up step."""
    import torch
    from transformers.models.deprecated.realm import (
        RealmEmbedder,
        RealmKnowledgeAugEncoder,
        RealmScorer,
    )

    torch.manual_seed(0)
    config = realm_config(a)
    # Separate query and document embedders, as realm-jax's default (model.share_embedders).
    scorer = RealmScorer(config, query_embedder=RealmEmbedder(config)).train()
    reader = RealmKnowledgeAugEncoder(config).train()
    params = [p for m in (scorer, reader) for p in m.parameters()]
    opt = torch.optim.AdamW(
        adamw_groups((scorer, reader), 0.01), lr=1e-4, betas=(0.9, 0.999), eps=1e-6
    )
    x = train_inputs(data, a)

    def step() -> float:
        relevance = scorer(**x["query"]).relevance_score  # [B, K]
        loss = reader(**x["reader"], relevance_score=relevance).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())

    t = timed(step, reps)
    return {"warmup_s": t["warmup_s"], "times": t["times"], "first_loss": t["first"]}


def run_embed(data, a: dict, reps: int) -> dict:
    """The document embedder alone, inference: every block of the table in batches of
    `embed_batch`, timed reps times after one warm-up pass."""
    import torch
    from transformers.models.deprecated.realm import RealmEmbedder

    torch.manual_seed(0)
    blocks = data["embed_blocks"].astype("int64")  # [N, Lb]
    embedder = RealmEmbedder(realm_config(a)).eval()
    bs = a["embed_batch"]
    batches = [
        (torch.from_numpy(c), torch.from_numpy((c != 0).astype("int64")), torch.from_numpy(s))
        for c, s in (
            (blocks[i : i + bs], segments(blocks[i : i + bs])) for i in range(0, len(blocks), bs)
        )
    ]

    def embed_all() -> None:
        with torch.inference_mode():
            for ids, mask, types in batches:
                embedder(input_ids=ids, attention_mask=mask, token_type_ids=types)

    t = timed(embed_all, reps)
    return {"warmup_s": t["warmup_s"], "times": t["times"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--task", choices=("train", "embed"), required=True)
    ap.add_argument("--inputs", required=True, help="the driver's .npz")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    pin_threads(args.threads)
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    data = dict(np.load(args.inputs))
    arch = json.loads(str(data.pop("arch")))
    run = run_train if args.task == "train" else run_embed
    out = run(data, arch, args.reps)
    out.update(
        peak_rss_gb=peak_rss_gb(),
        threads=torch.get_num_threads(),
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
    )
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
