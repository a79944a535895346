"""Write tests/fixtures/hf_realm/: tiny HuggingFace REALM checkpoints in PyTorch's pickle format
(`save_pretrained(..., safe_serialization=False)`) and their outputs, made by the real libraries.

    .venv-peer/bin/python bench/make_hf_fixtures.py [OUT]    # make peer-bench builds .venv-peer
    .venv-peer/bin/python bench/make_hf_fixtures.py --check-export DIR OUT.npz

The second form is tests/test_hf_export.py's peer check: transformers loads every folder that
`realm-jax export` wrote in DIR (failing on any missing or unexpected weight) and runs it on the
fixture inputs; OUT.npz gets the outputs under the names below, prefixed by the folder's name.

Runs in the side venv (torch 2.13.0 CPU + transformers 4.57.6; realm-jax itself never imports
torch). Every network is a randomly initialised RealmConfig model (hidden 32, 2 layers, a vocab
of 100 ids), each parameter then perturbed with N(0, 0.02) noise so no LayerNorm or bias is
trivial. Folders (each config.json + pytorch_model.bin):

  embedder/  RealmEmbedder, float16
  scorer/    RealmScorer with its own query embedder (query_embedder.* != embedder.*), float16
  encoder/   RealmKnowledgeAugEncoder, bfloat16
  reader/    RealmReader, float32
  openqa/    RealmForOpenQA with a 12-row block_emb, bfloat16
  dtypes.bin a torch.save'd dict of tensors of every supported dtype, strided and offset views

Half-precision folders are saved from models whose weights were rounded to that precision
first, and every output below is computed in float32 from those rounded weights, so an importer
that widens them exactly must reproduce the outputs. outputs.npz holds the inputs and outputs
(names below); tests/test_hf_pickle.py reads them without torch.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.models.deprecated.realm import (  # noqa: E402
    RealmConfig,
    RealmEmbedder,
    RealmForOpenQA,
    RealmKnowledgeAugEncoder,
    RealmReader,
    RealmScorer,
)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "fixtures", "hf_realm")
CLS, SEP = 2, 3  # token ids of the fixture inputs (the networks give no id a meaning)
B, K = 2, 4  # queries, candidates per query


def config() -> RealmConfig:
    return RealmConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_act="gelu_new",
        max_position_embeddings=40,
        retriever_proj_size=16,
        span_hidden_size=16,
        max_span_width=3,
        num_candidates=K,
        reader_beam_size=K,
        reader_seq_len=24,
        searcher_beam_size=6,
        num_block_records=12,
    )


def perturbed(model, dtype):
    """model with every parameter perturbed, rounded to `dtype`'s precision, kept in float32."""
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
            p.copy_(p.to(dtype).to(torch.float32))
        for name, b in model.named_buffers():
            if name == "block_emb":
                b.copy_(torch.randn_like(b).to(dtype).to(torch.float32))
    return model


def save(model, out: str, name: str, dtype) -> None:
    folder = os.path.join(out, name)
    model.config.architectures = [type(model).__name__]
    model.to(dtype).save_pretrained(folder, safe_serialization=False)
    model.to(torch.float32)
    for extra in ("generation_config.json",):
        path = os.path.join(folder, extra)
        if os.path.exists(path):
            os.remove(path)


def ids(gen: np.random.Generator, shape, length_of=None) -> torch.Tensor:
    """Random ids in [5, 100) with [CLS] first and [SEP] last."""
    x = torch.tensor(gen.integers(5, 100, size=shape), dtype=torch.long)
    x[..., 0], x[..., -1] = CLS, SEP
    return x


def main(out: str) -> None:
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    cfg = config()
    o: dict[str, np.ndarray] = {}

    # Inputs shared by the retrievers: B queries, B*K candidate blocks (title, body).
    q = ids(gen, (B, 10))
    qmask = torch.ones_like(q)
    qmask[1, -3:] = 0
    q[1, -3:] = 0
    d = ids(gen, (B * K, 14))
    d[:, 5] = SEP
    dmask = torch.ones_like(d)
    dmask[3, -4:] = 0
    d[3, -4:] = 0
    dtype_ids = torch.zeros_like(d)
    dtype_ids[:, 6:] = 1
    o.update(query_ids=q, query_mask=qmask, doc_ids=d, doc_mask=dmask, doc_type_ids=dtype_ids)

    with torch.no_grad():
        emb = perturbed(RealmEmbedder(cfg), torch.float16)
        o["embedder_query"] = emb(input_ids=q, attention_mask=qmask).projected_score
        o["embedder_doc"] = emb(
            input_ids=d, attention_mask=dmask, token_type_ids=dtype_ids
        ).projected_score
        save(emb, out, "embedder", torch.float16)

        scorer = perturbed(RealmScorer(cfg, query_embedder=RealmEmbedder(cfg)), torch.float16)
        so = scorer(
            input_ids=q,
            attention_mask=qmask,
            candidate_input_ids=d.view(B, K, -1),
            candidate_attention_mask=dmask.view(B, K, -1),
            candidate_token_type_ids=dtype_ids.view(B, K, -1),
        )
        o.update(
            scorer_relevance=so.relevance_score,
            scorer_query=so.query_score,
            scorer_candidates=so.candidate_score.reshape(B * K, -1),
        )
        save(scorer, out, "scorer", torch.float16)

        # The knowledge-augmented encoder: B*K joint sequences, MLM logits at 3 positions each.
        j = ids(gen, (B * K, 20))
        j[:, 8] = SEP
        jtype = torch.zeros_like(j)
        jtype[:, 9:] = 1
        jmask = torch.ones_like(j)
        jmask[5, -3:] = 0
        j[5, -3:] = 0
        positions = torch.tensor([[1, 4, 7]] * (B * K))
        enc = perturbed(RealmKnowledgeAugEncoder(cfg), torch.bfloat16)
        hidden = enc.realm(j, attention_mask=jmask, token_type_ids=jtype)[0]
        logits = enc.cls(hidden)
        o.update(
            joint_ids=j,
            joint_mask=jmask,
            joint_type_ids=jtype,
            joint_positions=positions,
            encoder_logits=torch.take_along_dim(logits, positions[..., None], dim=1),
        )
        save(enc, out, "encoder", torch.bfloat16)

        # The reader: K blocks for one question; span logits of every candidate span.
        r = ids(gen, (K, 18))
        r[:, 6] = SEP
        rtype = torch.zeros_like(r)
        rtype[:, 7:] = 1
        rmask = torch.ones_like(r)
        rmask[2, -2:] = 0
        r[2, -2:] = 0
        block_mask = torch.zeros_like(r, dtype=torch.bool)
        block_mask[:, 7:-1] = True
        block_mask[2, -3:] = False
        o.update(
            reader_ids=r, reader_mask=rmask, reader_type_ids=rtype, reader_block_mask=block_mask
        )
        rdr = perturbed(RealmReader(cfg), torch.float32)
        h = rdr.realm(r, attention_mask=rmask, token_type_ids=rtype)[0]
        o["reader_span_logits"], o["span_starts"], o["span_ends"] = rdr.qa_outputs(h, block_mask)
        save(rdr, out, "reader", torch.float32)

        # RealmForOpenQA: its question embedder, its block_emb index, its reader.
        qa = perturbed(RealmForOpenQA(cfg), torch.bfloat16)
        question = q[:1]
        qproj = qa.embedder(input_ids=question, attention_mask=qmask[:1]).projected_score
        o.update(
            openqa_query=qproj,
            openqa_block_emb=qa.block_emb,
            openqa_retrieval=torch.einsum("BD,QD->QB", qa.block_emb, qproj),
        )
        h = qa.reader.realm(r, attention_mask=rmask, token_type_ids=rtype)[0]
        o["openqa_span_logits"] = qa.reader.qa_outputs(h, block_mask)[0]
        save(qa, out, "openqa", torch.bfloat16)

    # Every dtype the reader supports, contiguous and not.
    base = torch.randn(4, 6)
    tensors = {
        "f32": base,
        "f64": base.double(),
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.arange(-6, 6, dtype=torch.int64).view(3, 4),
        "i32": torch.arange(5, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]),
        "transposed": base.t(),
        "offset": base[1:, 2:],
        "scalar": torch.tensor(3.5),
    }
    torch.save(tensors, os.path.join(out, "dtypes.bin"))
    for k, v in tensors.items():
        o[f"dtypes_{k}"] = v.float() if v.dtype in (torch.bfloat16, torch.float16) else v

    arrays = {k: v.detach().numpy() if torch.is_tensor(v) else v for k, v in o.items()}
    np.savez_compressed(os.path.join(out, "outputs.npz"), **arrays)
    total = sum(os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out}: {total / 1024:.0f} KiB")


CLASSES = {
    "embedder": RealmEmbedder,
    "doc_embedder": RealmEmbedder,
    "scorer": RealmScorer,
    "encoder": RealmKnowledgeAugEncoder,
    "reader": RealmReader,
    "openqa": RealmForOpenQA,
}


def load_exported(folder: str, name: str):
    """An exported folder through from_pretrained; an error on any missing/unexpected weight.
    A scorer gets its own query embedder (from_pretrained would tie it to `embedder`)."""
    kwargs = {}
    if name == "scorer":
        kwargs["query_embedder"] = RealmEmbedder(RealmConfig.from_pretrained(folder))
    model, info = CLASSES[name].from_pretrained(folder, output_loading_info=True, **kwargs)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{folder}: {bad}")
    return model.eval()


def check_export(root: str, out: str) -> None:
    i = {
        k: torch.from_numpy(v) for k, v in np.load(os.path.join(DEFAULT_OUT, "outputs.npz")).items()
    }
    o: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in CLASSES:
            if not os.path.isdir(os.path.join(root, name)):
                continue
            m = load_exported(os.path.join(root, name), name)
            if name in ("embedder", "doc_embedder"):
                o[f"{name}_query"] = m(input_ids=i["query_ids"], attention_mask=i["query_mask"])[0]
                o[f"{name}_doc"] = m(
                    input_ids=i["doc_ids"],
                    attention_mask=i["doc_mask"],
                    token_type_ids=i["doc_type_ids"],
                )[0]
            elif name == "scorer":
                so = m(
                    input_ids=i["query_ids"],
                    attention_mask=i["query_mask"],
                    candidate_input_ids=i["doc_ids"].view(B, K, -1),
                    candidate_attention_mask=i["doc_mask"].view(B, K, -1),
                    candidate_token_type_ids=i["doc_type_ids"].view(B, K, -1),
                )
                o["scorer_relevance"] = so.relevance_score
                o["scorer_query"] = so.query_score
            elif name == "encoder":
                h = m.realm(i["joint_ids"], i["joint_mask"], i["joint_type_ids"])[0]
                pos = i["joint_positions"][..., None]
                o["encoder_logits"] = torch.take_along_dim(m.cls(h), pos, dim=1)
            else:
                reader = m if name == "reader" else m.reader
                h = reader.realm(i["reader_ids"], i["reader_mask"], i["reader_type_ids"])[0]
                o[f"{name}_span_logits"] = reader.qa_outputs(h, i["reader_block_mask"])[0]
                if name == "openqa":
                    q = m.embedder(input_ids=i["query_ids"][:1], attention_mask=i["query_mask"][:1])
                    o["openqa_query"] = q[0]
                    o["openqa_block_emb"] = m.block_emb
    np.savez(out, **{k: v.numpy() for k, v in o.items()})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-export"]:
        check_export(sys.argv[2], sys.argv[3])
        sys.exit(0)
    target = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)
    os.makedirs(target, exist_ok=True)
    main(target)
