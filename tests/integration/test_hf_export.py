"""`realm-jax import` / `realm-jax export`: HuggingFace REALM folders into and out of a workdir.

realm-jax -> HF -> realm-jax must give back every exported parameter exactly; HF -> realm-jax ->
HF every tensor of the HF checkpoint (tests/fixtures/hf_realm, written by transformers 4.57.6);
and where the side venv exists (`make peer-bench` builds .venv-peer), transformers itself loads
the export with no missing weight and computes the fixture's outputs.
"""

import json
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from realm_jax import cli
from realm_jax.config import load_config
from realm_jax.interop import commands as hf_commands
from realm_jax.interop import hf_export, safe_pickle
from realm_jax.interop import hf_import as weights
from realm_jax.model.bert import ModelConfig
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf_realm")
PEER = os.path.join(REPO, ".venv-peer", "bin", "python")
CONFIG = os.path.join(REPO, "configs", "orqa.py") + ":smoke"


def _arch(**reader) -> list[str]:
    """Overrides giving both networks the fixtures' architecture (the reader's may differ)."""
    out = [
        "model.vocab_size=100",
        "model.proj_size=16",
        "model.span_hidden_size=16",
        "model.max_span_width=3",
    ]
    for part in ("embedder", "reader"):
        fields = {
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 40,
            "hidden_act": "gelu_new",
        }
        fields.update(reader if part == "reader" else {})
        out += [f"model.{part}.{k}={v}" for k, v in fields.items()]
    return out


def _cli(capsys, command: str, *args: str, overrides=()) -> tuple[int, list[str], str]:
    rc = cli.main([command, "--config", CONFIG, *args, *(f"--config.{o}" for o in overrides)])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out


def _random_params(config, seed: int) -> dict:
    """Every parameter of the config's networks drawn at random (shapes from eval_shape: no
    compilation), so no LayerNorm or bias is trivial."""
    from flax import linen as nn

    from realm_jax.model.inputs import init_inputs
    from realm_jax.model.realm import realm_model

    model = realm_model(config.model)
    shapes = jax.eval_shape(lambda r: model.init(r, *init_inputs(8, 8, 8)), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: rng.normal(0, 0.05, x.shape).astype(np.float32),
        nn.meta.unbox(shapes["params"]),
    )


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


# ------------------------------------------------------------------ realm-jax -> HF -> realm-jax


@pytest.fixture(scope="module")
def random_export(tmp_path_factory):
    """Random params (separate query and document embedders, every leaf perturbed) exported."""
    config = load_config(CONFIG, _arch())
    params = _random_params(config, seed=1)
    ecfg = ModelConfig.from_config(config.model, "embedder")
    rcfg = ModelConfig.from_config(config.model, "reader")
    block_emb = np.random.default_rng(2).normal(size=(7, 16)).astype(np.float32)
    extra = hf_commands.run_fields(config)
    assert extra["num_candidates"] == 4  # the fixture inputs' K: HF's scorer reads it
    folders, notes = hf_export.export_folders(params, ecfg, rcfg, block_emb, extra)
    out = tmp_path_factory.mktemp("random_export")
    for name, (cfg, tensors) in folders.items():
        hf_export.write_folder(str(out / name), cfg, tensors)
    return params, block_emb, out, notes


def test_round_trip_is_exact(random_export):
    params, block_emb, out, notes = random_export
    assert notes == []
    assert sorted(os.listdir(out)) == sorted(
        ["embedder", "doc_embedder", "scorer", "encoder", "reader", "openqa"]
    )
    _same(weights.import_folder(str(out / "embedder")).query_embedder, params["query_embedder"])
    _same(weights.import_folder(str(out / "doc_embedder")).query_embedder, params["doc_embedder"])
    scorer = weights.import_folder(str(out / "scorer"))
    _same(scorer.query_embedder, params["query_embedder"])
    _same(scorer.doc_embedder, params["doc_embedder"])
    no_span = {k: v for k, v in params["reader"].items() if k != "span"}
    _same(weights.import_folder(str(out / "encoder")).reader, no_span)
    _same(weights.import_folder(str(out / "reader")).reader, params["reader"])
    qa = weights.import_folder(str(out / "openqa"))
    assert qa.cls == "RealmForOpenQA"
    _same(qa.query_embedder, params["query_embedder"])
    _same(qa.reader, params["reader"])
    np.testing.assert_array_equal(qa.block_emb, block_emb)
    cfg = json.loads((out / "openqa" / "config.json").read_text())
    assert cfg["model_type"] == "realm" and cfg["architectures"] == ["RealmForOpenQA"]
    assert (cfg["hidden_size"], cfg["retriever_proj_size"], cfg["num_block_records"]) == (32, 16, 7)


def test_different_architectures_skip_openqa():
    config = load_config(CONFIG, _arch(hidden_size=48, intermediate_size=96))
    params = _random_params(config, seed=3)
    folders, notes = hf_export.export_folders(
        params,
        ModelConfig.from_config(config.model, "embedder"),
        ModelConfig.from_config(config.model, "reader"),
    )
    assert "openqa" not in folders and "reader" in folders and "embedder" in folders
    assert any("hidden_size: embedder 32 vs reader 48" in n for n in notes), notes
    assert folders["reader"][0]["hidden_size"] == 48 and folders["embedder"][0]["hidden_size"] == 32


# ------------------------------------------------------------------ HF -> realm-jax -> HF, CLI


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The RealmForOpenQA fixture imported into a workdir and exported again (the CLI)."""
    root = tmp_path_factory.mktemp("cli")
    work, out = str(root / "work"), str(root / "export")
    args = [f"--config.{o}" for o in _arch()]
    assert (
        cli.main(
            [
                "import",
                "--config",
                CONFIG,
                "--source",
                f"{FIXTURES}/openqa",
                "--workdir",
                work,
                *args,
            ]
        )
        == 0
    )
    assert cli.main(["export", "--config", CONFIG, "--workdir", work, "--out", out, *args]) == 0
    return work, out


def test_cli_import_export_keeps_every_hf_tensor(imported):
    work, out = imported
    src = safe_pickle.load_state_dict(f"{FIXTURES}/openqa/pytorch_model.bin")
    from safetensors.numpy import load_file

    got = load_file(f"{out}/openqa/model.safetensors")
    # realm-jax ties the MLM decoder; an embedder's MLM head and a reader's pooler are never
    # used (hf_export writes them as zeros)
    skip = (
        "reader.cls.predictions.decoder.weight",
        "embedder.cls.predictions.",
        "reader.realm.pooler.",
    )
    compared = [k for k in src if not k.startswith(skip)]
    assert len(compared) > 80 and set(compared) <= set(got)
    for k in compared:
        np.testing.assert_array_equal(got[k], np.asarray(src[k], np.float32), err_msg=k)
    hf = json.load(open(f"{FIXTURES}/openqa/config.json"))
    mine = json.load(open(f"{out}/openqa/config.json"))
    for k in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "hidden_act",
        "retriever_proj_size",
        "span_hidden_size",
        "max_span_width",
        "num_block_records",
        "layer_norm_eps",
        "reader_layer_norm_eps",
    ):
        assert mine[k] == hf[k], k


def test_imported_workdir_is_a_warm_start(imported):
    """`--config.model.init_from_realm=W` reads the imported networks (span head included)."""
    from realm_jax.train import warm_start

    work, _ = imported
    config = load_config(
        CONFIG,
        [
            *_arch(),
            f"model.init_from_realm={work}",
            "model.init_span_head_from_realm=true",
            "data.query_len=16",
            "data.block_len=24",
        ],
    )  # fit 40 positions
    got = warm_start.realm_params(work, config)
    hf = weights.import_folder(f"{FIXTURES}/openqa")
    _same(got["query_embedder"], hf.query_embedder)
    _same(got["doc_embedder"], hf.query_embedder)
    _same(got["reader"], hf.reader)


def _bad_folder(tmp_path, name: str, kind: str) -> str:
    folder = tmp_path / name
    shutil.copytree(f"{FIXTURES}/reader", folder)
    pkl = folder / "pytorch_model.bin"
    if kind == "truncated":
        pkl.write_bytes(pkl.read_bytes()[: pkl.stat().st_size // 2])
    elif kind == "wrong_class":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForQA"]}))
    elif kind == "callable":
        import zipfile

        with zipfile.ZipFile(pkl, "w") as z:
            z.writestr("archive/data.pkl", b"\x80\x02cposix\nsystem\n(X\x04\x00\x00\x00trueR.")
    elif kind == "vocab":
        (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    return str(folder)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("truncated", "pytorch_model.bin"),
        ("wrong_class", "BertForQA cannot be imported"),
        ("callable", "the pickle calls posix.system"),
        ("vocab", "vocab.txt differs from realm-jax's vocabulary"),
        ("vocab_size", "vocab_size: config 30522 vs checkpoint 100"),
    ],
)
def test_import_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, kind, message):
    source = _bad_folder(tmp_path, kind, kind)
    overrides = [o for o in _arch() if kind != "vocab_size" or "vocab_size" not in o]
    work = tmp_path / "work"
    rc, err, _ = _cli(
        capsys, "import", "--source", source, "--workdir", str(work), overrides=overrides
    )
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("realm-jax import: error: ") and message in err[0], err[0]
    assert not work.exists()


def test_export_bad_input(imported, tmp_path, capsys):
    work, _ = imported
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    cases = [
        (["--out", str(taken)], _arch(), "exists: give a new folder"),
        (["--out", str(tmp_path / "a"), "--checkpoint", "7"], _arch(), "one of the steps [0]"),
        (["--out", str(tmp_path / "b")], _arch(hidden_size=48), "does not match --config"),
        (["--out", str(tmp_path / "c"), "--checkpoint", "best"], _arch(), "no best/ checkpoint"),
    ]
    for args, overrides, message in cases:
        rc, err, _ = _cli(capsys, "export", "--workdir", work, *args, overrides=overrides)
        assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not any((tmp_path / n).exists() for n in "abc")


# ------------------------------------------------------------------ transformers loads it


def _peer_outputs(folder, out_npz) -> dict:
    if not os.path.exists(PEER):
        pytest.skip(f"needs {PEER} (torch + transformers: `make peer-bench` builds it)")
    r = subprocess.run(
        [
            PEER,
            os.path.join(REPO, "tests", "fixtures", "hf_realm", "make_fixtures.py"),
            "--check-export",
            str(folder),
            str(out_npz),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(out_npz))


def _close(a, b, atol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    valid = b > -1e30  # spans outside the block: float32's min on both sides
    np.testing.assert_array_equal(a > -1e30, valid)
    err = np.abs(a - b)[valid]
    assert (err <= np.maximum(atol, 1e-6 * np.abs(b[valid]))).all(), f"max err {err.max():.3g}"


def test_transformers_loads_the_export_of_an_import(imported, tmp_path):
    """HF -> realm-jax -> HF: transformers' outputs of the export are the fixture's."""
    _, out = imported
    got = _peer_outputs(out, tmp_path / "peer.npz")
    ref = np.load(f"{FIXTURES}/outputs.npz")
    _close(got["openqa_query"], ref["openqa_query"])
    _close(got["embedder_query"][:1], ref["openqa_query"])
    np.testing.assert_array_equal(got["openqa_block_emb"], ref["openqa_block_emb"])
    _close(got["openqa_span_logits"], ref["openqa_span_logits"])
    _close(got["reader_span_logits"], ref["openqa_span_logits"])


def test_transformers_matches_realm_jax_on_random_params(random_export, tmp_path):
    """realm-jax -> HF: transformers computes what realm-jax computes, every class."""
    import jax.numpy as jnp

    from realm_jax.model.realm import Embedder, Reader

    params, block_emb, out, _ = random_export
    got = _peer_outputs(out, tmp_path / "peer.npz")
    i = np.load(f"{FIXTURES}/outputs.npz")
    config = load_config(CONFIG, _arch())
    ecfg = ModelConfig.from_config(config.model, "embedder")
    rcfg = ModelConfig.from_config(config.model, "reader")

    def embed(name, ids, mask, segs):
        return Embedder(ecfg).apply({"params": params[name]}, ids, segs, mask)

    q = {
        n: embed(n, i["query_ids"], i["query_mask"], np.zeros_like(i["query_ids"]))
        for n in ("query_embedder", "doc_embedder")
    }
    d = {
        n: embed(n, i["doc_ids"], i["doc_mask"], i["doc_type_ids"])
        for n in ("query_embedder", "doc_embedder")
    }
    _close(got["embedder_query"], q["query_embedder"])
    _close(got["embedder_doc"], d["query_embedder"])
    _close(got["doc_embedder_doc"], d["doc_embedder"])
    _close(got["scorer_query"], q["query_embedder"])
    rel = jnp.einsum("bd,bkd->bk", q["query_embedder"], d["doc_embedder"].reshape(2, 4, -1))
    _close(got["scorer_relevance"], rel)
    reader = Reader(rcfg)
    logits = reader.apply(
        {"params": params["reader"]},
        i["joint_ids"],
        i["joint_type_ids"],
        i["joint_mask"],
        i["joint_positions"],
        method=Reader.mlm_logits,
    )
    _close(got["encoder_logits"], logits)
    spans = reader.apply(
        {"params": params["reader"]},
        i["reader_ids"],
        i["reader_type_ids"],
        i["reader_mask"],
        i["reader_block_mask"],
        method=Reader.span_logits,
    )[0]
    _close(got["reader_span_logits"], spans)
    _close(got["openqa_span_logits"], spans)
    np.testing.assert_array_equal(got["openqa_block_emb"], block_emb)
