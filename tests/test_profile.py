"""Step-time attribution: synthetic traces for the edge cases, real CPU traces for known
programs, and the identity compute + exposed comm + exposed memcpy + idle = step."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.planning import hlo
from jaxdist.profiling import spans as iv
from jaxdist.profiling.breakdown import breakdown
from jaxdist.profiling.report import profile
from jaxdist.profiling.xplane import load
from tests.helpers import cli, mesh_for

MS = 1_000_000  # ns


def xspace(planes: dict[str, dict[str, list[tuple]]]) -> bytes:
    """{plane: {line: [(name, start_ns, dur_ns, {stat: value})]}} -> serialized XSpace."""
    out = []
    for pid, (pname, lines) in enumerate(planes.items(), 1):
        names: dict[str, int] = {}
        stats: dict[str, int] = {}
        body = []
        for lid, (lname, events) in enumerate(lines.items(), 1):
            evs = []
            for name, start, dur, st in events:
                mid = names.setdefault(name, len(names) + 1)
                sts = []
                for k, v in st.items():
                    sid = stats.setdefault(k, len(stats) + 1)
                    val = f'str_value: "{v}"' if isinstance(v, str) else f"int64_value: {v}"
                    sts.append(f"stats {{ metadata_id: {sid} {val} }}")
                evs.append(
                    f"events {{ metadata_id: {mid} offset_ps: {int(start * 1000)} "
                    f"duration_ps: {int(dur * 1000)} {' '.join(sts)} }}"
                )
            body.append(f'lines {{ id: {lid} name: "{lname}" timestamp_ns: 0 {" ".join(evs)} }}')
        meta = [
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
            for n, i in names.items()
        ]
        meta += [
            f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
            for n, i in stats.items()
        ]
        out.append(f'planes {{ id: {pid} name: "{pname}" {" ".join(body + meta)} }}')
    return jax.profiler.ProfileData.text_proto_to_serialized_xspace("\n".join(out))


def write(tmp_path, planes) -> pathlib.Path:
    f = tmp_path / "host.xplane.pb"
    f.write_bytes(xspace(planes))
    return f


def rows_of(path):
    return breakdown(load(path))["steps"]


def assert_identity(rows):
    for r in rows:
        parts = r["compute_s"] + r["comm_exposed_s"] + r["memcpy_exposed_s"] + r["idle_s"]
        assert parts == pytest.approx(r["step_s"], abs=1e-9), r
        assert r["comm_overlapped_s"] + r["comm_exposed_s"] == pytest.approx(r["comm_s"])


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
    assert_identity([r])


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
    assert_identity(report["steps"])


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
    assert_identity([r])


def test_no_annotations_uses_executions_then_whole_trace(tmp_path):
    ev = lambda name, start, dur, run: (
        name,
        start,
        dur,
        {  # noqa: E731
            "hlo_op": name,
            "device_ordinal": 0,
            "run_id": run,
        },
    )
    f = write(
        tmp_path,
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
    f2 = write(
        tmp_path, {"/device:GPU:0": {"s": [("k", 0, 2 * MS, {}), ("k", 4 * MS, 2 * MS, {})]}}
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


def _trace(tmp_path, fn, *args, steps=3):
    jax.block_until_ready(fn(*args))  # compile outside the trace
    jax.profiler.start_trace(str(tmp_path))
    for s in range(steps):
        with jax.profiler.StepTraceAnnotation("train", step_num=s):
            jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    return tmp_path


def test_real_trace_pure_compute(tmp_path):
    mesh = mesh_for("data=8")
    x = jax.device_put(np.ones((8 * 64, 256), np.float32), NamedSharding(mesh, P("data")))
    w = jnp.ones((256, 256), jnp.float32)
    fn = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w) @ w)
    rows = rows_of(_trace(tmp_path, fn, x, w))
    assert len(rows) == 3 * 8
    assert all(r["comm_s"] == 0 and r["compute_s"] > 0 for r in rows)
    assert_identity(rows)


def test_real_trace_compute_plus_allreduce(tmp_path):
    mesh = mesh_for("data=8")
    x = jax.device_put(np.ones((8 * 64, 256), np.float32), NamedSharding(mesh, P("data")))
    fn = jax.jit(
        lambda x: jnp.sum(jnp.tanh(x @ x.T @ x), axis=0), out_shardings=NamedSharding(mesh, P())
    )
    text = fn.lower(x).compile().as_text()
    rep = profile(_trace(tmp_path, fn, x), text, dict(mesh.shape))
    rows = rep["steps"]
    assert all(r["comm_s"] > 0 and r["compute_s"] > 0 for r in rows)
    assert all(set(r["by_axis"]) == {"data"} for r in rows)
    # Each traced step moved every byte the compiled program's all-reduces hold, once.
    compiled = hlo.summarize(hlo.collectives(text, dict(mesh.shape)))
    want = compiled[("data", "all-reduce")]["bytes"]
    assert want > 0 and all(r["by_axis"]["data"]["all-reduce"]["bytes"] == want for r in rows)
    assert_identity(rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, axis, kind", [("data=8", "data", "all-reduce"), ("fsdp=8", "fsdp", "all-gather")]
)
def test_train_profile_attributes_dp_and_fsdp_steps(tmp_path, mesh, axis, kind):
    r = cli(
        "train",
        "--mesh",
        mesh,
        "--devices",
        "cpu:8",
        "--steps",
        "8",
        "--profile",
        "4:7",
        "--run-dir",
        str(tmp_path),
        "--log-every",
        "4",
        "--checkpoint-every",
        "100",
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "profile" / "breakdown.json").read_text())
    assert sorted({x["step"] for x in rep["steps"]}) == [4, 5, 6]
    assert len({x["device"] for x in rep["steps"]}) == 8
    assert_identity(rep["steps"])
    comm = cli("comm", "--mesh", mesh, "--devices", "cpu:8", "--json")
    assert comm.returncode == 0, comm.stderr
    expected = {(x["axis"], x["kind"]): x["bytes"] for x in json.loads(comm.stdout)["rows"]}
    for x in rep["steps"]:  # every traced step moved the bytes the compiled program says
        assert x["by_axis"][axis][kind]["bytes"] == expected[(axis, kind)]
    assert (tmp_path / "profile" / "breakdown.png").stat().st_size > 10_000
    again = cli("profile", str(tmp_path / "profile"), "--json", str(tmp_path / "b2.json"))
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "b2.json").read_text())["summary"]["steps"] == 3


@pytest.mark.slow
def test_watch_comm_warns_during_training(tmp_path):
    from rich.console import Console

    from jaxdist.checkpoint.interval import CheckpointConfig
    from jaxdist.data import DataConfig
    from jaxdist.metrics.records import read_metrics
    from jaxdist.optim import OptimConfig
    from jaxdist.step import StepConfig
    from jaxdist.train import LoopConfig, RunConfig, run
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    run(
        model_spec(get_model_config("tiny")),
        mesh_for("data=8"),
        STANDARD_RULES,
        RunConfig(
            optim=OptimConfig(),
            data=DataConfig(batch_size=16),
            step=StepConfig(),
            loop=LoopConfig(
                steps=9, log_every=4, run_dir=str(tmp_path), watch_comm=0.001, watch_every=4
            ),
            checkpoint=CheckpointConfig(every="100"),
        ),
        console=Console(quiet=True),
    )
    watches = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "watch"]
    # Windows at 4 (steps 4..6) and 8 (cut short by the end of the run, still reported).
    assert [w["step"] for w in watches] == [4, 8]
    assert watches[0]["comm_exposed"] > 0.001 and watches[0]["warnings"]
    assert (tmp_path / "watch" / "step_4" / "breakdown.json").exists()
