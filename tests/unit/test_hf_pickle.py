"""HuggingFace REALM checkpoints in PyTorch's pickle format, read without torch.

tests/fixtures/hf_realm/ was written by transformers 4.57.6 and torch 2.13.0
(tests/fixtures/hf_realm/make_fixtures.py): every REALM class saved with
save_pretrained(safe_serialization= False), in float32, float16 and bfloat16, and their outputs on
fixed inputs. Each imported network must compute HF's outputs (1e-4; 1e-6 relative above 10). A
pickle that names any callable other than the tensor rebuilds is refused before anything runs.
"""

import io
import json
import os
import pickle
import shutil
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.interop import hf_import as weights
from realm_jax.interop import safe_pickle
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import Embedder, Reader
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf_realm")


def close(a, b, atol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b)
    assert (err <= np.maximum(atol, 1e-6 * np.abs(b))).all(), f"max abs err {err.max():.3g}"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(os.path.join(FIXTURES, "outputs.npz")))


def _embed(params, fields, ids, mask, segs=None):
    segs = np.zeros_like(ids) if segs is None else segs
    return Embedder(ModelConfig(**fields)).apply({"params": params}, ids, segs, mask)


def _spans(params, fields, r):
    logits, starts, ends = Reader(ModelConfig(**fields)).apply(
        {"params": params},
        r["reader_ids"],
        r["reader_type_ids"],
        r["reader_mask"],
        r["reader_block_mask"],
        method=Reader.span_logits,
    )
    np.testing.assert_array_equal(starts, r["span_starts"])
    np.testing.assert_array_equal(ends, r["span_ends"])
    return np.asarray(logits)


def _close_spans(got, want):
    valid = want > -1e30  # HF marks spans outside the block with float32's min
    np.testing.assert_array_equal(got > -1e30, valid)
    close(got[valid], want[valid])


# ------------------------------------------------------------------ every class, HF's outputs


def test_embedder_float16_pickle(ref):
    got = weights.import_folder(os.path.join(FIXTURES, "embedder"))
    assert got.cls == "RealmEmbedder" and got.reader is None and got.doc_embedder is None
    p, f = got.query_embedder, got.fields
    close(_embed(p, f, ref["query_ids"], ref["query_mask"]), ref["embedder_query"])
    doc = _embed(p, f, ref["doc_ids"], ref["doc_mask"], ref["doc_type_ids"])
    close(doc, ref["embedder_doc"])


def test_scorer_query_and_candidate_embedders(ref):
    path = os.path.join(FIXTURES, "scorer")
    got = weights.import_folder(path)
    assert got.cls == "RealmScorer" and got.doc_embedder is not None
    f = got.fields
    q = _embed(got.query_embedder, f, ref["query_ids"], ref["query_mask"])
    d = _embed(got.doc_embedder, f, ref["doc_ids"], ref["doc_mask"], ref["doc_type_ids"])
    close(q, ref["scorer_query"])
    close(d, ref["scorer_candidates"])
    rel = jnp.einsum("bd,bkd->bk", q, d.reshape(q.shape[0], -1, d.shape[-1]))
    close(rel, ref["scorer_relevance"])
    # the warm-start entry point: which embedder
    doc, _ = weights.embedder_params(path, which="doc")
    close(_embed(doc, f, ref["doc_ids"], ref["doc_mask"], ref["doc_type_ids"]), d, atol=0)
    query, _ = weights.embedder_params(path)
    close(_embed(query, f, ref["query_ids"], ref["query_mask"]), q, atol=0)


def test_knowledge_augmented_encoder_bfloat16_mlm_logits(ref):
    got = weights.import_folder(os.path.join(FIXTURES, "encoder"))
    assert got.cls == "RealmKnowledgeAugEncoder" and got.query_embedder is None
    logits = Reader(ModelConfig(**got.fields)).apply(
        {"params": got.reader},
        ref["joint_ids"],
        ref["joint_type_ids"],
        ref["joint_mask"],
        ref["joint_positions"],
        method=Reader.mlm_logits,
    )
    close(logits, ref["encoder_logits"])


def test_reader_span_logits(ref):
    params, fields = weights.reader_params(os.path.join(FIXTURES, "reader"))
    assert "span" in params
    _close_spans(_spans(params, fields, ref), ref["reader_span_logits"])


def test_openqa_embedder_reader_and_block_emb(ref):
    path = os.path.join(FIXTURES, "openqa")
    got = weights.import_folder(path)
    assert got.cls == "RealmForOpenQA" and got.doc_embedder is None
    np.testing.assert_array_equal(got.block_emb, ref["openqa_block_emb"])
    q = _embed(got.query_embedder, got.fields, ref["query_ids"][:1], ref["query_mask"][:1])
    close(q, ref["openqa_query"])
    close(np.asarray(q) @ got.block_emb.T, ref["openqa_retrieval"])
    _close_spans(_spans(got.reader, got.fields, ref), ref["openqa_span_logits"])
    reader, _ = weights.reader_params(path)  # the warm-start entry points take it too
    embedder, _ = weights.embedder_params(path)
    np.testing.assert_array_equal(
        reader["span"]["dense_output"]["kernel"], got.reader["span"]["dense_output"]["kernel"]
    )
    np.testing.assert_array_equal(
        embedder["projection"]["kernel"], got.query_embedder["projection"]["kernel"]
    )


def test_every_dtype_and_view(ref):
    got = safe_pickle.load_state_dict(os.path.join(FIXTURES, "dtypes.bin"))
    for name, value in got.items():
        want = ref[f"dtypes_{name}"]
        assert value.shape == want.shape, name
        np.testing.assert_array_equal(value, want, err_msg=name)
    assert got["f16"].dtype == np.float16 and got["bf16"].dtype == np.float32
    assert got["i64"].dtype == np.int64 and got["bool"].dtype == np.bool_


# ------------------------------------------------------------------ choosing the file


def test_safetensors_preferred_and_wrong_classes(tmp_path):
    from safetensors.numpy import save_file

    folder = tmp_path / "both"
    shutil.copytree(os.path.join(FIXTURES, "embedder"), folder)
    tensors = safe_pickle.load_state_dict(str(folder / "pytorch_model.bin"))
    tensors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    tensors["cls.dense.bias"] = np.full_like(tensors["cls.dense.bias"], 7.0)
    save_file(tensors, str(folder / "model.safetensors"))
    params, _ = weights.embedder_params(str(folder))
    assert (params["projection"]["bias"] == 7.0).all()  # from model.safetensors

    with pytest.raises(weights.WeightImportError, match="RealmEmbedder holds no reader"):
        weights.reader_params(os.path.join(FIXTURES, "embedder"))
    gpt = tmp_path / "gpt"
    shutil.copytree(os.path.join(FIXTURES, "reader"), gpt)
    config = json.loads((gpt / "config.json").read_text())
    (gpt / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2Model"]}))
    with pytest.raises(weights.WeightImportError, match="GPT2Model cannot be imported"):
        weights.check_folder(str(gpt))


def test_sharded_checkpoint_and_one_named_scorer(tmp_path, ref):
    """A weights index over two shards; a scorer whose one embedder is stored once."""
    from safetensors.numpy import save_file

    src = os.path.join(FIXTURES, "reader")
    tensors = safe_pickle.load_state_dict(os.path.join(src, "pytorch_model.bin"))
    names = sorted(tensors)
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(os.path.join(src, "config.json"), folder)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({k: np.asarray(tensors[k]) for k in part}, str(folder / shard))
    index = {"weight_map": {k: s for s, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    params, fields = weights.reader_params(str(folder))
    _close_spans(_spans(params, fields, ref), ref["reader_span_logits"])

    scorer = safe_pickle.load_state_dict(os.path.join(FIXTURES, "scorer", "pytorch_model.bin"))
    one = {k: v for k, v in scorer.items() if k.startswith("query_embedder.")}
    hf = json.load(open(os.path.join(FIXTURES, "scorer", "config.json")))
    got = weights.import_tensors(hf, one, "one")
    assert got.doc_embedder is None
    q = _embed(got.query_embedder, got.fields, ref["query_ids"], ref["query_mask"])
    close(q, ref["scorer_query"])


# ------------------------------------------------------------------ unsafe or damaged pickles


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _value(x) -> bytes:
    return pickle.dumps(x, protocol=2)[2:-1]  # without PROTO and STOP


def _tensor_pickle(
    callable_=("torch._utils", "_rebuild_tensor_v2"),
    size=(2, 2),
    stride=(2, 1),
    offset=0,
    numel=4,
    args=None,
) -> bytes:
    """A state dict {"w": tensor} as torch.save pickles it, written opcode by opcode (no torch):
    `callable_` called on (persistent storage, offset, size, stride, False, OrderedDict())."""
    storage = (
        b"("
        + _value("storage")
        + _global("torch", "FloatStorage")
        + _value("0")
        + _value("cpu")
        + _value(numel)
        + b"tQ"  # MARK ... TUPLE, BINPERSID
    )
    hooks = _global("collections", "OrderedDict") + b")R"
    call_args = (
        _value(args)
        if args is not None
        else (
            b"("
            + storage
            + _value(offset)
            + _value(size)
            + _value(stride)
            + _value(False)
            + hooks
            + b"t"
        )
    )
    return b"\x80\x02}" + _value("w") + _global(*callable_) + call_args + b"Rs."


def _zip(path, pkl: bytes, data: bytes = np.arange(4, dtype="<f4").tobytes(), legacy=False):
    if legacy:
        path.write_bytes(pkl)
        return str(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", data)
    return str(path)


def test_handmade_tensor_pickle_reads(tmp_path):
    got = safe_pickle.load_state_dict(_zip(tmp_path / "ok.bin", _tensor_pickle()))
    np.testing.assert_array_equal(got["w"], [[0, 1], [2, 3]])
    got = safe_pickle.load_state_dict(
        _zip(tmp_path / "t.bin", _tensor_pickle(size=(2, 2), stride=(1, 2)))
    )
    np.testing.assert_array_equal(got["w"], [[0, 2], [1, 3]])


class _Evil:
    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


def test_foreign_callables_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    cmd = f"touch {marker}"
    cases = {
        "os.system": pickle.dumps({"w": _Evil(os.system, cmd)}, protocol=2),
        "builtins.eval": pickle.dumps(
            {"w": _Evil(eval, f"__import__('os').system({cmd!r})")}, protocol=2
        ),
        "posix.system": _tensor_pickle(callable_=("posix", "system"), args=(cmd,)),
        # a foreign callable where the tensor rebuild's backward hooks go
        "subprocess.call": _tensor_pickle().replace(
            _global("collections", "OrderedDict") + b")R",
            _global("subprocess", "call") + _value(([*cmd.split()],)) + b"R",
        ),
    }
    for name, pkl in cases.items():
        path = _zip(tmp_path / f"{name}.bin", pkl)
        with pytest.raises(safe_pickle.UnsafePickleError, match=name.replace(".", r"\.")):
            safe_pickle.load_state_dict(path)
        assert not marker.exists(), f"{name} ran"
    # through a weights folder: one WeightImportError naming the callable and the file
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "reader"), folder)
    _zip(folder / "pytorch_model.bin", cases["os.system"])
    with pytest.raises(
        weights.WeightImportError,
        match=r"pytorch_model.bin: the pickle calls "
        r"(os|posix)\.system",
    ):
        weights.reader_params(str(folder))
    assert not marker.exists()


def test_legacy_truncated_and_out_of_bounds_pickles(tmp_path):
    legacy = _zip(tmp_path / "legacy.bin", pickle.dumps({"w": 1}), legacy=True)
    with pytest.raises(safe_pickle.UnsafePickleError, match="legacy torch.save format"):
        safe_pickle.load_state_dict(legacy)
    folder = tmp_path / "legacy_folder"
    shutil.copytree(os.path.join(FIXTURES, "reader"), folder)
    shutil.copy(legacy, folder / "pytorch_model.bin")
    with pytest.raises(weights.WeightImportError, match="not a zip archive"):
        weights.check_folder(str(folder))  # before any model is built

    with pytest.raises(safe_pickle.UnsafePickleError, match="reaches element 4"):
        safe_pickle.load_state_dict(_zip(tmp_path / "oob.bin", _tensor_pickle(size=(2, 3))))
    with pytest.raises(safe_pickle.UnsafePickleError, match="its storage needs 64"):
        safe_pickle.load_state_dict(_zip(tmp_path / "short.bin", _tensor_pickle(numel=16)))

    whole = open(os.path.join(FIXTURES, "reader", "pytorch_model.bin"), "rb").read()
    for cut in (len(whole) // 2, len(whole) - 10):
        folder = tmp_path / f"cut{cut}"
        shutil.copytree(os.path.join(FIXTURES, "reader"), folder)
        (folder / "pytorch_model.bin").write_bytes(whole[:cut])
        with pytest.raises(weights.WeightImportError, match="pytorch_model.bin"):
            weights.reader_params(str(folder))


def test_unpickler_admits_only_the_rebuild_names():
    ok = [
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch", "HalfStorage"),
        ("collections", "OrderedDict"),
        ("torch", "bfloat16"),
    ]
    for module, name in ok:
        assert safe_pickle._allowed(module, name) is not None
    for module, name in [
        ("torch", "load"),
        ("torch._utils", "_rebuild_qtensor"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("builtins", "getattr"),
        ("collections", "defaultdict"),
    ]:
        with pytest.raises(safe_pickle.UnsafePickleError, match=f"{module}.{name}"):
            safe_pickle._Unpickler(io.BytesIO(b""), None).find_class(module, name)
