"""hlo_audit's reading of XLA's optimized HLO text, against counts made by hand on a small
module written here: a combined all-reduce, an all-gather in a loop of known trip count inside
another loop, an async all-gather, a reduce-scatter and an all-to-all."""

# ruff: noqa: E501  (HLO lines are as XLA writes them)

from realm_jax import hlo_audit

HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[2,8]{1,0} get-tuple-element(%p), index=1
  %all-gather.1 = f32[4,8]{1,0} all-gather(%x), channel_id=3, replica_groups=[2,2]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %all-gather.1)
}

%inner_cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (q: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %q = (s32[], f32[4,8]) parameter(0)
  %w = (s32[], f32[4,8]) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %y = bf16[16]{0} constant({...})
  %all-reduce.9 = bf16[16]{0} all-reduce(%y), channel_id=4, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = (s32[], f32[4,8]) tuple(%i, %z)
}

%outer_cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main.1_spmd (arg: f32[30,8]) -> f32[] {
  %arg = f32[30,8]{1,0} parameter(0)
  %all-reduce.2 = (f32[30,8]{1,0}, s32[3]{0}) all-reduce(%arg, %n), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%h), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %rs = f32[2,8]{1,0} reduce-scatter(%g), channel_id=5, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %a2a = (f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%u, %v), channel_id=6, replica_groups=[1,4]<=[4]
  %w = (s32[], f32[4,8]) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[] constant(0)
}
"""


def test_collectives_counted_by_hand():
    found = {c.name: c for c in hlo_audit.collectives(HLO, num_devices=4)}
    assert set(found) == {"all-reduce.2", "ags", "rs", "a2a", "all-gather.1", "all-reduce.9"}
    ar = found["all-reduce.2"]  # a combined all-reduce: 30*8*4 + 3*4 bytes, over axis_0 (2)
    assert (ar.kind, ar.bytes, ar.group_size, ar.count, ar.in_loop) == (
        "all-reduce",
        972,
        2,
        1,
        False,
    )
    ags = found["ags"]  # the async start's result, not its operand
    assert (ags.kind, ags.shapes, ags.bytes, ags.group_size) == (
        "all-gather",
        (("f32", (8, 8)),),
        256,
        4,
    )
    assert (found["rs"].kind, found["rs"].group_size) == ("reduce-scatter", 2)
    assert (found["a2a"].kind, found["a2a"].bytes, found["a2a"].group_size) == ("all-to-all", 32, 4)
    inner = found["all-gather.1"]  # 5 trips inside 3 trips
    assert (inner.count, inner.in_loop, inner.trip_known, inner.bytes) == (15, True, True, 128)
    outer = found["all-reduce.9"]  # bf16: 2 bytes a value, 3 trips
    assert (outer.bytes, outer.count, outer.bytes_per_step) == (32, 3, 96)
    total = 972 + 256 + 2 * 8 * 4 + 32 + 15 * 128 + 3 * 32
    assert hlo_audit.total_bytes(list(found.values())) == total
    s = hlo_audit.summary(list(found.values()))
    assert s["all-gather"] == {"instructions": 2, "executions": 16, "bytes": 256 + 15 * 128}
    assert [c.name for c in hlo_audit.having_dim(list(found.values()), [30])] == ["all-reduce.2"]
    assert "x15 in a loop" in inner.describe()
