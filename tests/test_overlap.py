"""What the schedule runs under each asynchronous collective (jaxdist.compiled.overlap), read from
a scheduled module written as XLA prints one: libtpu's asynchronous ragged all-to-all (an
`async-start` calling a computation that holds the collective), an async all-gather, and a
loop that runs one of them four times."""

from jaxdist.compiled import overlap

# Two devices on `expert`. In the loop body: a ragged all-to-all started, a fusion with a
# [64, 32] x [32, 16] dot scheduled before its done (2 x 64 x 16 x 32 = 65,536 FLOPs), then an
# all-gather with nothing under it. The loop runs 4 times.
MODULE = """HloModule m, is_scheduled=true

%async_computation.1 (p0: bf16[64,32], p1: bf16[80,32], p2: s32[2], p3: s32[2], p4: s32[2], p5: s32[2]) -> bf16[80,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[80,32]{1,0} parameter(1)
  %p2 = s32[2]{0} parameter(2)
  %p3 = s32[2]{0} parameter(3)
  %p4 = s32[2]{0} parameter(4)
  %p5 = s32[2]{0} parameter(5)
  ROOT %ragged-all-to-all.1 = bf16[80,32]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p3, %p4, %p5), channel_id=1, replica_groups={{0,1}}
}

%fused_dot (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[64,32], bf16[32,16], s32[2])) -> (s32[], bf16[64,32], bf16[32,16], s32[2]) {
  %t = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, s32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%t), index=2
  %s = s32[2]{0} get-tuple-element(%t), index=3
  %out = bf16[80,32]{1,0} broadcast(%x), dimensions={}
  %ragged-all-to-all-start.1 = ((bf16[64,32]{1,0}, bf16[80,32]{1,0}, s32[2]{0}, s32[2]{0}, s32[2]{0}, s32[2]{0}), bf16[80,32]{1,0}, u32[]) async-start(%x, %out, %s, %s, %s, %s), calls=%async_computation.1
  %fusion.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ragged-all-to-all-done.1 = bf16[80,32]{1,0} async-done(%ragged-all-to-all-start.1)
  %all-gather-start.1 = (bf16[64,32]{1,0}, bf16[128,32]{1,0}) all-gather-start(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %all-gather-done.1 = bf16[128,32]{1,0} all-gather-done(%all-gather-start.1)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, s32[2]{0}) tuple(%next, %x, %w, %s)
}

%cond (t: (s32[], bf16[64,32], bf16[32,16], s32[2])) -> pred[] {
  %t = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, s32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[64,32], w: bf16[32,16], s: s32[2]) -> bf16[64,32] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %s = s32[2]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, s32[2]{0}) tuple(%zero, %x, %w, %s)
  %loop = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, s32[2]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %y = bf16[64,32]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_the_matmuls_scheduled_under_each_async_collective_are_counted():
    found = overlap.scheduled(MODULE, {"expert": 2})
    by_kind = {s.kind: s for s in found}
    assert set(by_kind) == {"ragged-all-to-all", "all-gather"}
    ragged = by_kind["ragged-all-to-all"]
    assert ragged.axes == ("expert",) and ragged.executions == 4
    assert ragged.flops_under == 2 * 64 * 16 * 32
    assert ragged.bytes == 80 * 32 * 2
    assert by_kind["all-gather"].flops_under == 0
    rows = overlap.summary(found)
    assert rows["expert ragged-all-to-all"] == {
        "count": 4,
        "with_compute": 4,
        "flops_under": 4 * 2 * 64 * 16 * 32,
        "bytes": 4 * 80 * 32 * 2,
    }
    assert rows["expert all-gather"]["with_compute"] == 0


def test_a_synchronous_collective_has_nothing_under_it():
    sync = MODULE.replace(
        "%ragged-all-to-all-start.1 = ((bf16[64,32]{1,0}, bf16[80,32]{1,0}, s32[2]{0}, "
        "s32[2]{0}, s32[2]{0}, s32[2]{0}), bf16[80,32]{1,0}, u32[]) async-start(%x, %out, "
        "%s, %s, %s, %s), calls=%async_computation.1",
        "%ragged-all-to-all.9 = bf16[80,32]{1,0} ragged-all-to-all(%x, %out, %s, %s, %s, %s), "
        "channel_id=1, replica_groups={{0,1}}",
    ).replace(
        "%ragged-all-to-all-done.1 = bf16[80,32]{1,0} async-done(%ragged-all-to-all-start.1)",
        "%keep = bf16[80,32]{1,0} copy(%ragged-all-to-all.9)",
    )
    assert sync != MODULE
    assert {s.kind for s in overlap.scheduled(sync, {"expert": 2})} == {"all-gather"}
