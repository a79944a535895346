"""The release's TF1 checkpoints without TensorFlow (interop/tf_checkpoint.py) and their
HuggingFace REALM names (interop/release_checkpoint.py), against tests/fixtures/release/: made
by TensorFlow's own Saver, with the values TensorFlow reads back
(tests/fixtures/release/make_fixtures.py rebuilds them in a side venv)."""

import base64
import json
import os
import shutil

import numpy as np
import pytest

from realm_jax.interop import release_checkpoint as rc
from realm_jax.interop import tf_checkpoint as tc
from tests.conftest import REPO

FIX = os.path.join(REPO, "tests", "fixtures", "release")
H, L, INTER, V, P, T, PROJ, SPAN = 16, 2, 36, 100, 24, 2, 12, 6  # the fixtures' sizes
CHECKPOINTS = {  # reference name -> a path form that reaches it
    "misc": "misc",  # a folder with a `checkpoint` state file
    "embedder": "embedder",  # a TF-Hub module folder (variables/variables)
    "bert": "bert/variables/variables",  # a prefix
    "orqa": "orqa",  # ORQA's model_dir (export/best_default/checkpoint/, no state file)
    "block_emb": "embedder/encoded/encoded.ckpt.index",  # the .index file itself
}


def _reference(name):
    with open(os.path.join(FIX, "reference", name + ".json")) as f:
        meta = json.load(f)["variables"]
    return meta, np.load(os.path.join(FIX, "reference", name + ".npz"))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_every_variable_equals_what_tensorflow_reads(name):
    meta, arrays = _reference(name)
    ckpt = tc.TFCheckpoint(os.path.join(FIX, CHECKPOINTS[name]))
    assert ckpt.names() == sorted(meta)
    for var, m in meta.items():
        got = ckpt.read(var)
        assert list(got.shape) == m["shape"], var
        if m["dtype"] == "string":
            assert got.dtype == object
            assert [base64.b64encode(x).decode() for x in got.reshape(-1)] == m["base64"]
        elif m["dtype"] == "bfloat16":
            assert got.dtype.name == "bfloat16"
            np.testing.assert_array_equal(got.view(np.uint16), arrays[var])
        else:
            assert got.dtype == arrays[var].dtype, var
            np.testing.assert_array_equal(got, arrays[var])
    assert tc.list_variables(os.path.join(FIX, CHECKPOINTS[name])) == [
        (n, meta[n]["shape"]) for n in sorted(meta)
    ]


def test_dtypes_covered():
    meta, _ = _reference("misc")
    dtypes = {m["dtype"] for m in meta.values()}
    want = {"float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "int8"}
    assert want | {"bool", "string"} <= dtypes


def _copy(tmp_path, rel):
    dst = tmp_path / os.path.basename(rel)
    shutil.copytree(os.path.join(FIX, rel), dst)
    return dst


def test_path_forms(tmp_path):
    bert = os.path.join(FIX, "bert", "variables", "variables")
    orqa = os.path.join(FIX, "orqa", "export", "best_default", "checkpoint", "model.ckpt-300")
    assert tc.resolve_prefix(os.path.join(FIX, "bert")) == bert
    assert tc.resolve_prefix(bert + ".index") == bert
    assert tc.resolve_prefix(os.path.join(FIX, "orqa")) == orqa
    assert tc.resolve_prefix(os.path.dirname(orqa)) == orqa  # the single .index there
    # A state file written on another machine: its absolute path falls back to the basename.
    misc = _copy(tmp_path, "misc")
    (misc / "checkpoint").write_text('model_checkpoint_path: "/elsewhere/run/model.ckpt-7"\n')
    assert tc.resolve_prefix(str(misc)) == str(misc / "model.ckpt-7")
    (misc / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-9"\n')
    with pytest.raises(tc.CheckpointError, match="model.ckpt-9.*no .index"):
        tc.resolve_prefix(str(misc))
    with pytest.raises(tc.CheckpointError, match="no TensorFlow checkpoint"):
        tc.TFCheckpoint(str(tmp_path / "nothing"))
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.index", "b.index"):
        (two / n).write_bytes(b"")
    with pytest.raises(tc.CheckpointError, match="2 checkpoints and no `checkpoint` state"):
        tc.resolve_prefix(str(two))


def test_corrupt_data_is_caught_per_tensor(tmp_path):
    folder = _copy(tmp_path, "bert")
    ckpt = tc.TFCheckpoint(str(folder))
    entry = ckpt.entries["bert/encoder/layer_1/intermediate/dense/kernel"]
    shard = ckpt.shard_path(entry.shard_id)
    data = bytearray(open(shard, "rb").read())
    data[entry.offset + 17] ^= 0x40
    open(shard, "wb").write(bytes(data))
    with pytest.raises(
        tc.CheckpointError,
        match=r"data-00000-of-00001: bert/encoder/layer_1/"
        r"intermediate/dense/kernel: checksum mismatch",
    ):
        ckpt.read(entry.name)
    assert ckpt.read(entry.name, verify=False).shape == (H, INTER)  # the check caught it
    _, ref = _reference("bert")
    np.testing.assert_array_equal(
        ckpt.read("bert/pooler/dense/bias"), ref["bert/pooler/dense/bias"]
    )


def test_truncated_and_missing_files(tmp_path):
    folder = _copy(tmp_path, "bert")
    ckpt = tc.TFCheckpoint(str(folder))
    last = max(ckpt.entries.values(), key=lambda e: e.offset)
    shard = ckpt.shard_path(0)
    os.truncate(shard, last.offset + 10)
    with pytest.raises(tc.CheckpointError, match=f"truncated: {last.name} needs bytes"):
        ckpt.read(last.name)
    os.remove(shard)
    with pytest.raises(tc.CheckpointError, match="missing data shard"):
        ckpt.read(last.name)
    index = ckpt.prefix + ".index"
    raw = open(index, "rb").read()
    open(index, "wb").write(raw[:-20])
    with pytest.raises(tc.CheckpointError, match="bad magic"):
        tc.TFCheckpoint(str(folder))
    open(index, "wb").write(raw[:30])
    with pytest.raises(tc.CheckpointError, match="truncated"):
        tc.TFCheckpoint(str(folder))


def _index_block(raw: bytes) -> tuple[int, int]:
    """(offset, size) of the index block, from the table's footer."""
    footer = raw[-48:]
    _, pos = tc._varint(footer, 0)
    _, pos = tc._varint(footer, pos)
    offset, pos = tc._varint(footer, pos)
    return offset, tc._varint(footer, pos)[0]


def test_index_block_checksum_and_snappy(tmp_path):
    folder = _copy(tmp_path, "misc")
    index = str(folder / "model.ckpt-7.index")
    raw = bytearray(open(index, "rb").read())
    offset, size = _index_block(bytes(raw))
    bad = bytearray(raw)
    bad[offset + 1] ^= 1
    open(index, "wb").write(bytes(bad))
    with pytest.raises(
        tc.CheckpointError, match=f"checksum mismatch in the block at byte {offset}"
    ):
        tc.TFCheckpoint(str(folder))
    snappy = bytearray(raw)  # the compression type byte set to snappy, its crc made right
    snappy[offset + size] = 1
    crc = tc.mask_crc(tc.crc32c(bytes(snappy[offset : offset + size + 1])))
    snappy[offset + size + 1 : offset + size + 5] = crc.to_bytes(4, "little")
    open(index, "wb").write(bytes(snappy))
    with pytest.raises(tc.CheckpointError, match="snappy-compressed"):
        tc.TFCheckpoint(str(folder))


def test_protobuf_reader():
    # field 1 varint 7; field 4 int64 -2 (ten-byte varint); field 6 fixed32; field 2 message
    msg = bytes([0x08, 7, 0x20]) + b"\xfe" + b"\xff" * 8 + b"\x01" + b"\x35\x01\x02\x03\x04"
    msg += bytes([0x12, 4, 0x12, 2, 0x08, 5])
    f = tc.proto_fields(msg)
    assert f[1] == [7] and tc._int64(f[4][0]) == -2 and f[6] == [0x04030201]
    assert tc.proto_fields(tc.proto_fields(f[2][0])[2][0]) == {1: [5]}
    with pytest.raises(tc.CheckpointError, match="truncated"):
        tc.proto_fields(bytes([0x12, 9, 1]))


# ------------------------------------------------------------------------------ HF names
def _bert_names(p: str) -> dict:
    """transformers' RealmBertModel state-dict names and shapes (Linear weights [out, in])."""
    e = f"{p}embeddings."
    out = {
        e + "word_embeddings.weight": (V, H),
        e + "position_embeddings.weight": (P, H),
        e + "token_type_embeddings.weight": (T, H),
        e + "LayerNorm.weight": (H,),
        e + "LayerNorm.bias": (H,),
        f"{p}pooler.dense.weight": (H, H),
        f"{p}pooler.dense.bias": (H,),
    }
    for i in range(L):
        lp = f"{p}encoder.layer.{i}."
        for n in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ):
            out[f"{lp}{n}.weight"], out[f"{lp}{n}.bias"] = (H, H), (H,)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{lp}{n}.weight"], out[f"{lp}{n}.bias"] = (H,), (H,)
        out[f"{lp}intermediate.dense.weight"], out[f"{lp}intermediate.dense.bias"] = (
            (INTER, H),
            (INTER,),
        )
        out[f"{lp}output.dense.weight"], out[f"{lp}output.dense.bias"] = (H, INTER), (H,)
    return out


def _mlm_names(p: str) -> dict:
    c = f"{p}cls.predictions."
    return {
        c + "transform.dense.weight": (H, H),
        c + "transform.dense.bias": (H,),
        c + "transform.LayerNorm.weight": (H,),
        c + "transform.LayerNorm.bias": (H,),
        c + "bias": (V,),
    }


def _embedder_names(p: str) -> dict:
    return {
        **_bert_names(p + "realm."),
        **_mlm_names(p),
        f"{p}cls.dense.weight": (PROJ, H),
        f"{p}cls.dense.bias": (PROJ,),
        f"{p}cls.LayerNorm.weight": (PROJ,),
        f"{p}cls.LayerNorm.bias": (PROJ,),
    }


def _reader_names(p: str) -> dict:
    q = f"{p}qa_outputs."
    return {
        **_bert_names(p + "realm."),
        **_mlm_names(p),
        q + "dense_intermediate.weight": (2 * SPAN, H),
        q + "dense_intermediate.bias": (2 * SPAN,),
        q + "dense_output.weight": (1, SPAN),
        q + "dense_output.bias": (1,),
        q + "layer_normalization.weight": (SPAN,),
        q + "layer_normalization.bias": (SPAN,),
    }


EXPECTED = {
    "embedder": ("RealmEmbedder", _embedder_names("")),
    "bert": ("RealmKnowledgeAugEncoder", {**_bert_names("realm."), **_mlm_names("")}),
    "orqa": ("RealmForOpenQA", {**_embedder_names("embedder."), **_reader_names("reader.")}),
}
# Pairs read off transformers' load_tf_weights_in_realm / orqa_model.py, checked value by value.
PAIRS = {
    "embedder": [
        (
            "module/module/module/bert/embeddings/word_embeddings",
            "realm.embeddings.word_embeddings.weight",
        ),
        (
            "module/module/module/bert/encoder/layer_1/intermediate/dense/kernel",
            "realm.encoder.layer.1.intermediate.dense.weight",
        ),
        (
            "module/module/dense/kernel",
            "cls.dense.weight",
        ),
        (
            "module/module/LayerNorm/gamma",
            "cls.LayerNorm.weight",
        ),
        (
            "module/module/module/cls/predictions/output_bias",
            "cls.predictions.bias",
        ),
    ],
    "bert": [
        (
            "bert/encoder/layer_0/attention/self/key/kernel",
            "realm.encoder.layer.0.attention.self.key.weight",
        ),
        (
            "bert/embeddings/LayerNorm/beta",
            "realm.embeddings.LayerNorm.bias",
        ),
        (
            "cls/predictions/transform/dense/kernel",
            "cls.predictions.transform.dense.weight",
        ),
    ],
    "orqa": [
        (
            "module/module/module/module/bert/pooler/dense/kernel",
            "embedder.realm.pooler.dense.weight",
        ),
        (
            "module/module/module/dense/kernel",
            "embedder.cls.dense.weight",
        ),
        (
            "reader/module/bert/encoder/layer_1/output/dense/kernel",
            "reader.realm.encoder.layer.1.output.dense.weight",
        ),
        (
            "reader/dense/kernel",
            "reader.qa_outputs.dense_intermediate.weight",
        ),
        (
            "reader/dense_1/kernel",
            "reader.qa_outputs.dense_output.weight",
        ),
        (
            "reader/layer_normalization/gamma",
            "reader.qa_outputs.layer_normalization.weight",
        ),
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_release_names_map_to_hf_realm(name):
    kind, want = EXPECTED[name]
    got_kind, state, _ = rc.read_release_checkpoint(os.path.join(FIX, name), with_block_emb=False)
    assert got_kind == kind
    assert {n: tuple(v.shape) for n, v in state.items()} == want
    _, ref = _reference(name)
    for tf_name, hf_name in PAIRS[name]:
        value = ref[tf_name].T if tf_name.endswith("kernel") else ref[tf_name]
        np.testing.assert_array_equal(state[hf_name], value)
    # Every tensor is exactly one TF variable's value, transposed if and only if a kernel.
    mapped = [tf for tf in ref.files if not tf.endswith(("adam_m", "adam_v", "global_step"))]
    for hf_name, value in state.items():
        hits = [
            (tf, transposed)
            for tf in mapped
            for transposed, arr in ((False, ref[tf]), (True, ref[tf].T))[: ref[tf].ndim]
            if arr.shape == value.shape and np.array_equal(arr, value)
        ]
        assert len(hits) == 1, (hf_name, hits)
        assert hits[0][1] == hits[0][0].endswith("kernel"), (hf_name, hits)
    assert all(v.flags.c_contiguous and v.dtype == np.float32 for v in state.values())


def test_config_block_emb_and_split(caplog):
    kind, state, block_emb = rc.read_release_checkpoint(os.path.join(FIX, "embedder"))
    _, ref = _reference("block_emb")
    np.testing.assert_array_equal(block_emb, ref["block_emb"])  # from encoded/encoded.ckpt
    cfg = rc.hf_config(kind, state, num_heads=2, num_blocks=len(block_emb))
    assert cfg["architectures"] == ["RealmEmbedder"] and cfg["retriever_proj_size"] == PROJ
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (H, L, INTER)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"]) == (V, P, T)
    assert cfg["hidden_act"] == "gelu_new" and cfg["num_block_records"] == 20
    with pytest.raises(ValueError, match="num_heads"):
        rc.hf_config(kind, state)  # 16 is no multiple of 64
    kind, state, block_emb = rc.read_release_checkpoint(
        os.path.join(FIX, "orqa"), block_emb_path=os.path.join(FIX, "embedder")
    )
    np.testing.assert_array_equal(block_emb, ref["block_emb"])
    assert rc.hf_config(kind, state, num_heads=2)["span_hidden_size"] == SPAN
    emb, reader = rc.split_open_qa(state)
    assert set(emb) == set(_embedder_names("")) and set(reader) == set(_reader_names(""))
    with caplog.at_level("DEBUG", logger="realm_jax.interop.release_checkpoint"):
        rc.read_release_checkpoint(os.path.join(FIX, "bert"))
    assert "cls/seq_relationship/output_weights" in caplog.text


def test_unknown_layouts_are_refused():
    with pytest.raises(rc.ReleaseCheckpointError, match="no REALM/ORQA model.*dtypes/"):
        rc.read_release_checkpoint(os.path.join(FIX, "misc"))
    with pytest.raises(rc.ReleaseCheckpointError, match="only block_emb"):
        rc.read_release_checkpoint(os.path.join(FIX, "embedder", "encoded", "encoded.ckpt"))


def test_gs_paths(tmp_path_factory):
    """The same reads from a gs:// copy of the fixtures (fake-gcs-server, tests/support/)."""
    from realm_jax import fs
    from realm_jax.interop import block_records
    from tests.support import fake_gcs

    with fake_gcs.module_server(tmp_path_factory, "realm-release") as _:
        root = "gs://realm-release/release"
        fs.upload_tree(FIX, root)
        kind, state, block_emb = rc.read_release_checkpoint(
            root + "/orqa", block_emb_path=root + "/embedder"
        )
        local = rc.read_release_checkpoint(os.path.join(FIX, "orqa"), with_block_emb=False)[1]
        assert kind == "RealmForOpenQA" and state.keys() == local.keys()
        assert all(np.array_equal(state[n], local[n]) for n in state)
        np.testing.assert_array_equal(block_emb, _reference("block_emb")[1]["block_emb"])
        assert tc.resolve_prefix(root + "/misc") == root + "/misc/model.ckpt-7"
        pairs = list(block_records.read_release_blocks(root + "/blocks.tfr"))
        assert pairs == list(block_records.read_release_blocks(os.path.join(FIX, "blocks.tfr")))
        npy = block_records.load_npy_strings(root + "/block_records.npy")
        assert [x.decode() for x in npy] == [t for _, t in pairs]


# ------------------------------------------------------------------------------ the writer
@pytest.mark.parametrize("name", ["embedder", "bert", "orqa", "block_emb"])
def test_writer_reproduces_tensorflows_bytes(tmp_path, name):
    """write_checkpoint of the values TensorFlow read back gives TensorFlow's own files, byte
    for byte (index table, entries, crc32c, data layout)."""
    meta, ref = _reference(name)
    prefix = tc.resolve_prefix(os.path.join(FIX, CHECKPOINTS[name]))
    values = {n: ref[n] for n in meta}
    out = tc.write_checkpoint(str(tmp_path / "sub" / "model.ckpt"), values)
    for suffix in (".index", ".data-00000-of-00001"):
        with open(prefix + suffix, "rb") as a, open(out + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


def test_writer_large_tables_and_dtypes(tmp_path):
    """An index past one table block (TensorFlow's 256 KiB), and every numeric dtype."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    values = {
        f"scope_{i % 7}/layer_{i}/{'x' * (i % 50)}/kernel": rng.normal(size=(i % 3 + 1,)).astype(
            np.float32
        )
        for i in range(6000)
    }
    values.update(
        {
            "d/bf16": rng.normal(size=(3, 2)).astype(ml_dtypes.bfloat16),
            "d/f16": rng.normal(size=(4,)).astype(np.float16),
            "d/i64": np.int64(-5),
            "d/bool": np.array([True, False]),
            "d/empty": np.zeros((0, 3), np.float32),
        }
    )
    prefix = tc.write_checkpoint(str(tmp_path / "big"), values)
    assert os.path.getsize(prefix + ".index") > tc.TABLE_BLOCK_SIZE
    ckpt = tc.TFCheckpoint(prefix)
    assert ckpt.names() == sorted(values)
    for name, want in values.items():
        got = ckpt.read(name)
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want), name
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="numeric tensors only"):
        tc.write_checkpoint(str(tmp_path / "s"), {"s": np.array([b"a"], dtype=object)})


def test_run_params_vocab_and_config_fields(tmp_path):
    run = rc.run_params(os.path.join(FIX, "orqa"))
    assert run["retriever_module_path"] == "gs://realm-data/cc_news_pretrained/embedder"
    assert rc.run_params(os.path.join(FIX, "bert")) == {}
    kind, state, _ = rc.read_release_checkpoint(os.path.join(FIX, "orqa"), with_block_emb=False)
    cfg = rc.hf_config(kind, state, fallback_heads=4, run=run)
    assert cfg["num_attention_heads"] == 4 and cfg["max_span_width"] == 10
    assert (
        cfg["reader_seq_len"] == 64
        and rc.hf_config(kind, state, num_heads=2)["num_attention_heads"] == 2
    )
    assert rc.module_vocab(os.path.join(FIX, "embedder")) is None
    folder = _copy(tmp_path, "embedder")
    (folder / "assets").mkdir()
    (folder / "assets" / "vocab.txt").write_text("[PAD]\n")
    assert rc.module_vocab(str(folder)) == str(folder / "assets" / "vocab.txt")
    (folder / "params.json").write_text("[1, 2]")
    with pytest.raises(rc.ReleaseCheckpointError, match="not ORQA's run parameters"):
        rc.run_params(str(folder))
