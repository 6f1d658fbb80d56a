"""A two-device, two-step CPU trace written by hand, and its breakdown worked out on paper.

It holds what XLA:CPU's traces hold (compare a `jax.profiler` trace of a jitted step run with
XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true): a `/host:CPU` plane whose `python` line carries
the `train` step annotations (stat `step_num`), and one line per runtime thread
(`tf_XLAPjRtCpuClient/<id>`) with an event per HLO op executed (stats `hlo_op`, `hlo_module`,
`program_id`, `run_id`, `device_ordinal`), each followed by its `end: <op>` marker; collectives
enclose `Rendezvous` and `InvokeRendezvous` events; an execution ends with `ThunkExecutor::
Execute (wait for completion)`. A device's ops may run on several threads at once (the thunk
executor runs independent ops concurrently): that is how a collective here overlaps compute.
Plus the `/host:metadata` and `Task Environment` planes that every trace has.

Timeline, in microseconds (| marks the step annotations: step 10 is [1000, 2000), step 11 is
[2000, 2800), but device 0's fusion.2 of step 11 runs to 2900, so step 11's window is
[2000, 2900)):

    step 10  device 0  fusion.1 1000-1300, all-reduce.1 1200-1500 (another thread),
                       copy-start.1 1450-1550, fusion.2 1600-1900
             device 1  fusion.1 1000-1350, all-reduce.1 1350-1500, fusion.2 1500-1800
    step 11  device 0  fusion.1 2000-2200, all-reduce.1 2200-2300, fusion.2 2300-2900,
                       all-gather.2 2300-2400 (another thread)
             device 1  fusion.1 2000-2100, all-reduce.1 2100-2300, all-gather.2 2300-2400
                       (another thread), fusion.2 2300-2500, copy-start.1 2500-2600
"""

import pathlib

from tests.xspace import write

US = 1_000  # ns
_SRC = "external/xla+/xla/backends/cpu/runtime/thunk_executor.cc"
RUN_ID = {10: -859184372, 11: -859184371}

# The compiled program the trace ran: a 256-float all-reduce (256 x 4 = 1024 bytes) and a
# gather of [64,128] floats (64 x 128 x 4 = 32768 bytes), both over the `data` axis of 2.
HLO = """HloModule jit_train_step, is_scheduled=true, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main.1_spmd (param: f32[32,128]) -> (f32[256], f32[64,128]) {
  %param = f32[32,128]{1,0} parameter(0), sharding={devices=[2,1]<=[2]}
  %fusion.1 = f32[256]{0} fusion(%param), kind=kLoop
  %all-reduce.1 = f32[256]{0} all-reduce(%fusion.1), channel_id=1, \
replica_groups=mesh['data'=2] {'data'}, use_global_device_ids=true, to_apply=%add
  %copy-start.1 = (f32[32,128]{1,0}, f32[32,128]{1,0}, u32[]) copy-start(%param)
  %all-gather.2 = f32[64,128]{1,0} all-gather(%param), channel_id=2, \
replica_groups=mesh['data'=2] {'data'}, dimensions={0}, use_global_device_ids=true
  %fusion.2 = f32[64,128]{1,0} fusion(%all-gather.2, %all-reduce.1), kind=kLoop
  ROOT %tuple = (f32[256]{0}, f32[64,128]{1,0}) tuple(%all-reduce.1, %fusion.2)
}
"""
MESH = {"data": 2}
BYTES = {"all-reduce": 256 * 4, "all-gather": 64 * 128 * 4}


def _op(name: str, step: int, device: int, start: float, end: float) -> list[tuple]:
    stats = {
        "hlo_op": name,
        "hlo_module": "jit_train_step",
        "program_id": 7,
        "run_id": RUN_ID[step],
        "device_ordinal": device,
        "_src": _SRC,
    }
    events = [(name, start * US, (end - start) * US, stats)]
    if name.startswith(("all-reduce", "all-gather")):
        kind = name.split(".")[0].replace("-", " ")
        key = (
            f"{kind} RendezvousKey{{run_id=RunId: {RUN_ID[step]}, global_devices=[0, 1], "
            f"num_local_participants=2, collective_op_kind=cross_module, op_id=1}}"
        )
        rendezvous = {"num_threads": 2, "name": key, "id": device}
        events.append(("Rendezvous", (start + 5) * US, (end - start - 10) * US, rendezvous))
        events.append(("InvokeRendezvous", (start + 6) * US, 2 * US, {}))
    events.append((f"end: {name}", end * US, 300, {"_ct": 0, "_c": 1 << 33, "_src": _SRC}))
    return events


def _done(step: int, device: int, at: float) -> tuple:
    stats = {"run_id": RUN_ID[step], "device_ordinal": device, "_src": "cpu_client.cc"}
    return ("ThunkExecutor::Execute (wait for completion)", at * US, 50, stats)


def planes() -> dict:
    python = [
        ("PjitFunction(train_step)", 990 * US, 5 * US, {}),
        ("train", 1000 * US, 1000 * US, {"_r": 1, "step_num": 10}),
        ("train", 2000 * US, 800 * US, {"_r": 1, "step_num": 11}),
    ]
    thread_a = [
        *_op("fusion.1", 10, 0, 1000, 1300),
        *_op("copy-start.1", 10, 0, 1450, 1550),
        *_op("fusion.2", 10, 0, 1600, 1900),
        _done(10, 0, 1901),
        *_op("fusion.1", 11, 1, 2000, 2100),
        *_op("all-reduce.1", 11, 1, 2100, 2300),
        *_op("fusion.2", 11, 1, 2300, 2500),
        *_op("copy-start.1", 11, 1, 2500, 2600),
        _done(11, 1, 2601),
    ]
    thread_b = [*_op("all-reduce.1", 10, 0, 1200, 1500), *_op("all-gather.2", 11, 1, 2300, 2400)]
    thread_c = [
        *_op("fusion.1", 10, 1, 1000, 1350),
        *_op("all-reduce.1", 10, 1, 1350, 1500),
        *_op("fusion.2", 10, 1, 1500, 1800),
        _done(10, 1, 1801),
        *_op("fusion.1", 11, 0, 2000, 2200),
        *_op("all-reduce.1", 11, 0, 2200, 2300),
        *_op("fusion.2", 11, 0, 2300, 2900),
        _done(11, 0, 2901),
    ]
    thread_d = _op("all-gather.2", 11, 0, 2300, 2400)
    return {
        "/host:metadata": {},
        "/host:CPU": {
            "python": python,
            "tf_XLAPjRtCpuClient/1001": thread_a,
            "tf_XLAPjRtCpuClient/1002": thread_b,
            "tf_XLAPjRtCpuClient/1003": thread_c,
            "tf_XLAPjRtCpuClient/1004": thread_d,
        },
        "Task Environment": {},
    }


PLANE_STATS = {
    "/host:metadata": {"jax_version": "0.11.2", "cpu_version": "cpu"},
    "/host:CPU": {"process_id": 4242},
}

# Per (step, device), in microseconds, worked from the timeline above; W is the step window.
# step 10, device 0 (W = 1000..2000, 1000):
#   compute C = fusion.1 + fusion.2 = 300 + 300 = 600
#   comm M = all-reduce.1 = 300, of which 1200..1300 under fusion.1: hidden 100, exposed 200
#   sync: device 1's all-reduce.1 took 150 (its transfer), device 0's 300: waited 150
#   memcpy X = copy-start.1 = 100; 1450..1500 lies under the all-reduce: exposed 50
#   idle: 1550..1600 and 1900..2000 = 150
# step 10, device 1: C = 350 + 300 = 650; M = 150, none under compute: exposed 150; sync 0
#   (the shortest); no memcpy; idle 1800..2000 = 200
# step 11, device 0 (W = 2000..2900, 900): C = 200 + 600 = 800; M = all-reduce 100 (exposed)
#   + all-gather 100 (under fusion.2: hidden) = 200; sync 0 (its all-reduce the shortest,
#   both all-gathers 100); idle 0
# step 11, device 1: C = 100 + 200 = 300; M = all-reduce 200 (exposed) + all-gather 100 (under
#   fusion.2) = 300, hidden 100, exposed 200; sync 200 - 100 = 100; memcpy 2500..2600, 100, all
#   exposed; idle 2600..2900 = 300
EXPECTED = {
    (10, 0): dict(step=1000, compute=600, comm=300, hidden=100, exposed=200, sync=150,
                  memcpy=100, memcpy_exposed=50, idle=150),
    (10, 1): dict(step=1000, compute=650, comm=150, hidden=0, exposed=150, sync=0,
                  memcpy=0, memcpy_exposed=0, idle=200),
    (11, 0): dict(step=900, compute=800, comm=200, hidden=100, exposed=100, sync=0,
                  memcpy=0, memcpy_exposed=0, idle=0),
    (11, 1): dict(step=900, compute=300, comm=300, hidden=100, exposed=200, sync=100,
                  memcpy=100, memcpy_exposed=100, idle=300),
}  # fmt: skip
# Per (step, device): {kind: (time, exposed)} of the `data` axis's collectives, microseconds.
BY_AXIS = {
    (10, 0): {"all-reduce": (300, 200)},
    (10, 1): {"all-reduce": (150, 150)},
    (11, 0): {"all-reduce": (100, 100), "all-gather": (100, 0)},
    (11, 1): {"all-reduce": (200, 200), "all-gather": (100, 0)},
}
# Who arrived last in each step (waited least), and how long the other device waited for it.
STRAGGLERS = [(10, 1, 150), (11, 0, 100)]


def write_trace(path: pathlib.Path) -> pathlib.Path:
    """This trace as host.xplane.pb in folder `path` (or as `path`, a .pb file)."""
    return write(path, planes(), PLANE_STATS)
