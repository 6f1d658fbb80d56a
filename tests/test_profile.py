"""Step-time attribution: a two-device trace written by hand (tests/cpu_trace.py) whose every
part is worked out on paper, synthetic traces for the edge cases, and real CPU traces of
programs whose collectives follow from their shapes."""

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.cli.main import main
from jaxdist.errors import ConfigError
from jaxdist.profiling import spans as iv
from jaxdist.profiling.breakdown import breakdown
from jaxdist.profiling.report import profile
from jaxdist.profiling.xplane import load
from tests import cpu_trace
from tests.helpers import mesh_for
from tests.xspace import write

MS = 1_000_000  # ns
US = 1e-6  # s
FIELDS = {
    "step": "step_s",
    "compute": "compute_s",
    "comm": "comm_s",
    "hidden": "comm_overlapped_s",
    "exposed": "comm_exposed_s",
    "sync": "sync_s",
    "memcpy": "memcpy_s",
    "memcpy_exposed": "memcpy_exposed_s",
    "idle": "idle_s",
}


def rows_of(path):
    return breakdown(load(path))["steps"]


def test_hand_written_trace_every_part_of_every_step(tmp_path):
    rep = profile(cpu_trace.write_trace(tmp_path), cpu_trace.HLO, cpu_trace.MESH)
    rows = {(r["step"], r["device"]): r for r in rep["steps"]}
    assert sorted(rows) == sorted(cpu_trace.EXPECTED)
    for key, want in cpu_trace.EXPECTED.items():
        got = {k: rows[key][f] for k, f in FIELDS.items()}
        assert got == pytest.approx({k: v * US for k, v in want.items()}, abs=1e-12), key
        assert set(rows[key]["by_axis"]) == {"data"}, key
        by_kind = {
            kind: (v["count"], v["time_s"], v["exposed_s"], v["bytes"])
            for kind, v in rows[key]["by_axis"]["data"].items()
        }
        assert by_kind == {
            kind: (
                1,
                pytest.approx(t * US),
                pytest.approx(e * US, abs=1e-12),
                cpu_trace.BYTES[kind],
            )
            for kind, (t, e) in cpu_trace.BY_AXIS[key].items()
        }, key
    s = rep["summary"]
    assert s["stragglers"] == [
        {"step": step, "device": d, "others_waited_s": pytest.approx(w * US)}
        for step, d, w in cpu_trace.STRAGGLERS
    ]
    assert (s["steps"], s["devices"]) == (2, 2)
    # Steps of 1000 and 900 us: p50 halfway, p90 nine tenths of the way (linear).
    assert s["step_time_s"] == pytest.approx({"p50": 950 * US, "p90": 990 * US, "max": 1000 * US})
    # Means over the four device-steps: compute (600 + 650 + 800 + 300) / 4 = 587.5 of a mean
    # step of (1000 + 1000 + 900 + 900) / 4 = 950; exposed comm (200 + 150 + 100 + 200) / 4.
    assert s["mean_per_device"]["compute_s"] == pytest.approx(587.5 * US)
    assert s["fraction_of_step"]["compute_s"] == pytest.approx(587.5 / 950)
    assert s["fraction_of_step"]["comm_exposed_s"] == pytest.approx(162.5 / 950)


def test_overlap_gap_and_async_pair(tmp_path):
    f = write(
        tmp_path,
        {
            "/host:CPU": {"python": [("train", 0, 20 * MS, {"step_num": 3})]},
            "/device:GPU:0": {
                "Stream #1": [("fusion", 0, 10 * MS, {"hlo_op": "fusion.1"})],
                "Stream #2": [
                    ("ncclDevKernel_AllReduce", 5 * MS, 10 * MS, {"hlo_op": "all-reduce-start.1"})
                ],
            },
        },
    )
    (r,) = rows_of(f)
    assert r["step"] == 3 and r["step_s"] == pytest.approx(0.020)
    assert r["compute_s"] == pytest.approx(0.010) and r["comm_s"] == pytest.approx(0.010)
    assert r["comm_overlapped_s"] == pytest.approx(0.005)
    assert r["comm_exposed_s"] == pytest.approx(0.005) and r["idle_s"] == pytest.approx(0.005)


def test_profiler_overhead_is_not_device_work(tmp_path):
    # XLA's CUPTI collector names a device line holding its own overhead events "CUPTI
    # overhead" (cupti_collector.cc, GetDeviceXLineName); only the kernel is busy time.
    f = write(
        tmp_path,
        {
            "/host:CPU": {"python": [("train", 0, 10 * MS, {"step_num": 0})]},
            "/device:GPU:0": {
                "Stream #1(Kernel)": [("gemm", 0, 4 * MS, {"hlo_op": "fusion.1"})],
                "CUPTI overhead": [("CUPTI overhead", 5 * MS, 3 * MS, {})],
            },
        },
    )
    (r,) = rows_of(f)
    assert r["compute_s"] == pytest.approx(0.004) and r["idle_s"] == pytest.approx(0.006)


def test_sync_wait_names_the_straggler(tmp_path):
    ar = {"hlo_op": "all-reduce.7"}
    f = write(
        tmp_path,
        {
            "/host:CPU": {"python": [("train", 0, 10 * MS, {"step_num": 0})]},
            # device 1 computes longer; device 0 waits 3 ms inside the all-reduce for it
            "/device:GPU:0": {
                "s": [("f", 0, 2 * MS, {"hlo_op": "fusion"}), ("ar", 2 * MS, 4 * MS, ar)]
            },
            "/device:GPU:1": {
                "s": [("f", 0, 5 * MS, {"hlo_op": "fusion"}), ("ar", 5 * MS, 1 * MS, ar)]
            },
        },
    )
    report = breakdown(load(f))
    by_dev = {r["device"]: r for r in report["steps"]}
    assert by_dev[0]["sync_s"] == pytest.approx(0.003) and by_dev[1]["sync_s"] == 0
    assert report["summary"]["stragglers"] == [
        {"step": 0, "device": 1, "others_waited_s": pytest.approx(0.003)}
    ]


def test_memcpy_and_containers(tmp_path):
    f = write(
        tmp_path,
        {
            "/host:CPU": {"python": [("train", 0, 10 * MS, {"step_num": 0})]},
            "/device:GPU:0": {
                "s": [
                    ("while.1", 0, 9 * MS, {"hlo_op": "while.1"}),  # encloses the rest: not counted
                    ("f", 0, 4 * MS, {"hlo_op": "fusion.2"}),
                    ("MemcpyD2D", 3 * MS, 3 * MS, {}),  # 1 ms hidden under compute, 2 ms exposed
                ]
            },
        },
    )
    (r,) = rows_of(f)
    assert r["compute_s"] == pytest.approx(0.004)
    assert r["memcpy_s"] == pytest.approx(0.003) and r["memcpy_exposed_s"] == pytest.approx(0.002)
    assert r["idle_s"] == pytest.approx(0.004)


def test_no_annotations_uses_executions_then_whole_trace(tmp_path):
    def ev(name, start, dur, run):
        return (name, start, dur, {"hlo_op": name, "device_ordinal": 0, "run_id": run})

    f = write(
        tmp_path / "a",
        {
            "/host:CPU": {
                "t": [
                    ev("fusion.1", 0, 2 * MS, 11),
                    ev("all-reduce.1", 2 * MS, 1 * MS, 11),
                    ev("fusion.1", 5 * MS, 2 * MS, 12),
                    ev("all-reduce.1", 7 * MS, 1 * MS, 12),
                ]
            }
        },
    )
    rows = rows_of(f)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["comm_s"] == pytest.approx(0.001) for r in rows)
    assert [r["step_s"] for r in rows] == [pytest.approx(0.003), pytest.approx(0.003)]
    f2 = write(
        tmp_path / "b",
        {"/device:GPU:0": {"s": [("k", 0, 2 * MS, {}), ("k", 4 * MS, 2 * MS, {})]}},
    )
    (r,) = rows_of(f2)
    assert r["step_s"] == pytest.approx(0.006) and r["idle_s"] == pytest.approx(0.002)


def test_bad_traces_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no .xplane.pb trace under"):
        load(tmp_path)
    empty = tmp_path / "e.xplane.pb"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty"):
        load(empty)
    bad = tmp_path / "b.xplane.pb"
    bad.write_bytes(b"\x00garbage" * 50)
    with pytest.raises(ConfigError, match="not a readable XSpace|no device op events"):
        load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.xplane.pb")


def test_interval_algebra():
    a = iv.union([(0, 5), (3, 8), (10, 12)])
    assert a == [(0, 8), (10, 12)]
    b = iv.union([(4, 11)])
    assert iv.intersect(a, b) == [(4, 8), (10, 11)]
    assert iv.subtract(a, b) == [(0, 4), (11, 12)]
    assert iv.measure(iv.subtract(a, b)) + iv.measure(iv.intersect(a, b)) == iv.measure(a)


def _trace(tmp_path, fn, *args, steps=3) -> tuple[pathlib.Path, list[float]]:
    """Traces `steps` annotated calls; returns the trace folder and the wall-clock of each
    step, measured around its annotation by this test's own clock."""
    jax.block_until_ready(fn(*args))  # compile outside the trace
    walls = []
    jax.profiler.start_trace(str(tmp_path))
    for s in range(steps):
        t0 = time.perf_counter()
        with jax.profiler.StepTraceAnnotation("train", step_num=s):
            jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t0)
    jax.profiler.stop_trace()
    return tmp_path, walls


def _check_windows(rows, walls) -> None:
    """Every device in every step, each step's window within the wall-clock around it."""
    assert sorted((r["step"], r["device"]) for r in rows) == [
        (s, d) for s in range(len(walls)) for d in range(8)
    ]
    for r in rows:
        assert 0 < r["compute_s"] <= r["step_s"] <= walls[r["step"]] + 1e-4, (r, walls)


def test_real_trace_pure_compute(tmp_path):
    mesh = mesh_for("data=8")
    x = jax.device_put(np.ones((8 * 64, 256), np.float32), NamedSharding(mesh, P("data")))
    w = jnp.ones((256, 256), jnp.float32)
    fn = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w) @ w)
    path, walls = _trace(tmp_path, fn, x, w)
    rows = rows_of(path)
    _check_windows(rows, walls)
    # Rows split over the devices, the weight on each: row-wise work, nothing to exchange.
    assert all(r["comm_s"] == 0 and r["sync_s"] == 0 and r["by_axis"] == {} for r in rows)


def test_real_trace_compute_plus_allreduce(tmp_path):
    mesh = mesh_for("data=8")
    x = jax.device_put(np.ones((8 * 64, 256), np.float32), NamedSharding(mesh, P("data")))
    w = jnp.ones((256, 256), jnp.float32)
    # Each device sums its 64 rows of tanh(x @ w) into 256 column sums; the 8 partial sums
    # are added over the data axis: one all-reduce of 256 f32 = 1024 bytes per step.
    fn = jax.jit(
        lambda x, w: jnp.sum(jnp.tanh(x @ w), axis=0), out_shardings=NamedSharding(mesh, P())
    )
    text = fn.lower(x, w).compile().as_text()
    path, walls = _trace(tmp_path, fn, x, w)
    rep = profile(path, text, dict(mesh.shape))
    _check_windows(rep["steps"], walls)
    for r in rep["steps"]:
        sent = {
            a: {k: (v["count"], v["bytes"]) for k, v in ks.items()}
            for a, ks in r["by_axis"].items()
        }
        assert sent == {"data": {"all-reduce": (1, 256 * 4)}}, r
        assert r["comm_s"] > 0
    # Each step's all-reduce is one instance on 8 devices: whoever arrived last is named.
    assert [st["step"] for st in rep["summary"]["stragglers"]] == [0, 1, 2]
    assert rep["model"]["gradient_bytes_per_step"] == pytest.approx(1024)


def _train(run_dir: pathlib.Path, mesh: str, steps: int, *flags: str) -> None:
    """`jaxdist train` of tiny in this process (its 8 fake CPU devices are --devices cpu:8),
    tracing steps 1..3; the flags `setup` adds to XLA_FLAGS for a profile are undone after."""
    args = ["--mesh", mesh, "--devices", "cpu:8", "--steps", str(steps), "--profile", "1:4"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        rc = main(
            [
                "train",
                *args,
                *flags,
                "--run-dir",
                str(run_dir),
                "--log-every",
                "4",
                "--checkpoint-every",
                "100",
                "--compile-cache",
                "off",
            ]
        )
    assert rc == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """mesh -> its run directory, each trained once for the module. data=8 also watches
    communication every 4 steps (test_watch_comm_warns_during_training): one run serves both,
    and `jaxdist profile RUN_DIR` must then pick the --profile window among the traces."""
    runs = {}

    def get(mesh: str) -> pathlib.Path:
        if mesh not in runs:
            run_dir = tmp_path_factory.mktemp(mesh.replace("=", ""))
            if mesh == "data=8":
                _train(run_dir, mesh, 9, "--watch-comm", "0.001", "--watch-every", "4")
            else:
                _train(run_dir, mesh, 4)
            runs[mesh] = run_dir
        return runs[mesh]

    return get


@pytest.mark.slow
# tiny's 476,416 parameters (tests/test_planner.py works them out), fp32. data=8: every
# gradient all-reduced once per step, and one fp32 scalar with them: 4 x 476,416 + 4 bytes.
# fsdp=8: every weight has an `embed` dim, split over fsdp, so each is gathered where it is
# used: the 394,240 floats of the two layers in the forward scan and again in the backward,
# the other 82,176 (embeddings, head, final norm) once: 4 x (2 x 394,240 + 82,176) bytes.
# The compiled step gathers 1024 floats fewer (0.12%), the size of the layers' four norm
# vectors (4 x 2 x 128), as if they were gathered once rather than twice.
@pytest.mark.parametrize(
    "mesh, axis, kind, hand_bytes, rel",
    [
        ("data=8", "data", "all-reduce", 4 * 476_416 + 4, 0),
        ("fsdp=8", "fsdp", "all-gather", 4 * (2 * 394_240 + 82_176), 0.002),
    ],
)
def test_train_profile_attributes_dp_and_fsdp_steps(
    trained, tmp_path, capsys, mesh, axis, kind, hand_bytes, rel
):
    run_dir = trained(mesh)
    rep = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    assert sorted({x["step"] for x in rep["steps"]}) == [1, 2, 3]
    assert len({x["device"] for x in rep["steps"]}) == 8
    capsys.readouterr()
    comm_args = ["--mesh", mesh, "--devices", "cpu:8", "--json", "--compile-cache", "off"]
    assert main(["comm", *comm_args]) == 0
    comm = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = {(x["axis"], x["kind"]): x["bytes"] for x in comm["rows"]}
    for x in rep["steps"]:  # every traced step moved the bytes the compiled program says
        assert x["by_axis"][axis][kind]["bytes"] == expected[(axis, kind)]
        assert x["by_axis"][axis][kind]["bytes"] == pytest.approx(hand_bytes, rel=rel, abs=0)
    assert (run_dir / "profile" / "breakdown.png").stat().st_size > 10_000
    # `jaxdist profile` of the run directory and of its profile/ say what the run said.
    for path, name in ((run_dir, "run.json"), (run_dir / "profile", "profile.json")):
        assert main(["profile", str(path), "--json", str(tmp_path / name)]) == 0
        assert json.loads((tmp_path / name).read_text()) == rep, path
    assert {(x["axis"], x["kind"]) for x in rep["model"]["per_axis"]} >= {(axis, kind)}


@pytest.mark.slow
def test_watch_comm_warns_during_training(trained, tmp_path):
    from jaxdist.metrics.records import read_metrics

    run_dir = trained("data=8")  # 9 steps, watching every 4, beside a --profile 1:4 window
    records = read_metrics(run_dir / "metrics.jsonl")
    watches = [r for r in records if r.get("event") == "watch"]
    # Windows at 4 (steps 4..6) and 8 (cut short by the end of the run, still reported).
    assert [w["step"] for w in watches] == [4, 8]
    assert watches[0]["comm_exposed"] > 0.001 and watches[0]["warnings"]
    # `jaxdist profile` of a watch window finds the HLO and mesh the trainer left beside it.
    window = run_dir / "watch" / "step_4"
    assert main(["profile", str(window), "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again == json.loads((window / "breakdown.json").read_text())
    assert again["model"]["per_axis"] and again["model"]["projection"]


# A real replica run's trace (test_profile_report holds the same on a written trace, fast):
# -m experiment.
@pytest.mark.experiment
def test_replica_run_report_and_jaxdist_profile_print_the_same_rows(tmp_path, capsys):
    """A run of replica groups meeting every 2 steps, traced over steps 1..3 (step 1 and 3 run
    the outer step): `jaxdist profile RUN` prints the report the run printed, row for row,
    the outer step's row and the `replica` collective with them."""
    run_dir = tmp_path / "run"
    _train(run_dir, "replica=2,fsdp=4", 4, "--sync-every", "2")
    out, err = capsys.readouterr()
    ran = (out + err).splitlines()
    ran = ran[ran.index(next(ln for ln in ran if ln.startswith("trace: "))) :]
    assert main(["profile", str(run_dir), "--json", str(tmp_path / "p.json")]) == 0
    again = capsys.readouterr().out.splitlines()
    assert ran[: len(again)] == again
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(
        (run_dir / "profile" / "breakdown.json").read_text()
    )
    text = "\n".join(again)
    assert "communication of the outer step (replica groups)" in text
    assert any(ln.split("│")[1:3] == [" replica ", " all-to-all "] for ln in again), text
