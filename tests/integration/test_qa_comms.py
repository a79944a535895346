"""What QA's fine-tuning step fetches, read from XLA's optimized HLO on 4 fake CPU devices (a
2x2 mesh), as tests/integration/test_comms.py reads the other programs (issue 58): the tokens
of the reader_beam_size blocks it reads (B x R x Lb ids, 2 bytes each), never those of the
whole retriever beam (B x k x Lb: 369 MB of int32 a step at base, 64 x 5000 x 288), whose
answer test runs where the blocks live and sends [B, k] flags (mips.owner_test).

Measured at smoke size (configs/orqa.py:smoke, B 8, k 16, R 3, Lb 128) on 2x2: the step's
collectives 17,655,428 -> 17,600,252 bytes; its token fetch s32[8,16,128] (65,536 B) ->
u32[8,3,64] (6,144 B) plus the beam's answer flags u8[8,16] (128 B)."""

import jax

from realm_jax import plan, sharding
from realm_jax.config import load_config

NUM_BLOCKS = 1000
BEAM = 40  # a retriever beam no other dimension of the step has
INTEGERS = ("s32", "u32", "s16", "u16")


def _audit():
    """(config, the QA step's collectives) on the first 4 fake devices, a 2x2 mesh."""
    config = load_config(
        "configs/orqa.py:smoke", ["mesh.shape=(2,2)", f"qa.retriever_beam_size={BEAM}"]
    )
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
    program = plan.PROGRAMS["qa"](config, mesh, NUM_BLOCKS)[0]
    return config, plan.analyse(program, None, config, mesh)["communication"]["_found"]


def test_qa_step_fetches_the_read_blocks_tokens_not_the_beams():
    config, found = _audit()
    B, R = int(config.train.batch_size), int(config.qa.reader_beam_size)
    Lb = int(config.data.block_len)
    tokens = [  # integer collectives of [B, blocks, Lb] ids (or Lb / 2 uint32 pairs of them)
        (c, dtype, dims)
        for c in found
        for dtype, dims in c.shapes
        if dtype in INTEGERS and len(dims) == 3 and dims[-1] in (Lb, (Lb + 1) // 2)
    ]
    assert tokens, [c.describe() for c in found]
    c, dtype, dims = max(tokens, key=lambda t: t[0].bytes)
    assert dims[:2] == (B, R), c.describe()  # the read blocks, not the beam of BEAM
    assert c.bytes == B * R * Lb * 2, c.describe()  # 2 bytes an id on the wire
    assert not [t for t in tokens if BEAM in t[2]], [t[0].describe() for t in tokens]
    flags = [c for c in found for t, dims in c.shapes if dims == (B, BEAM) and t in ("u8", "pred")]
    assert flags, [c.describe() for c in found]  # the beam's answer test: B x k bytes
