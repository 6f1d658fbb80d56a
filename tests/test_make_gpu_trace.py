"""tests/make_gpu_trace.py, the GPU fixture trimmer, on a raw-looking trace worked out on paper."""

import json

import pytest
from jax.profiler import ProfileData

from tests.make_gpu_trace import trim
from tests.xspace import write

MS = 1e6  # ns


def _raw(tmp_path):
    ar = {"hlo_op": "all-reduce-start.1", "hlo_module": "jit_train_step"}
    return write(
        tmp_path / "raw" / "host.xplane.pb",
        {
            "/host:CPU": {
                # step 5 is [0, 10) ms, step 6 [10, 18) ms; the rest is host noise
                "python": [
                    ("train", 0, 9 * MS, {"step_num": 5}),
                    ("train", 10 * MS, 8 * MS, {"step_num": 6}),
                    ("PjitFunction(train_step)", 0.5 * MS, 1 * MS, {}),
                ],
                "tf_pjrt_thread": [("ThunkExecute", 1 * MS, 2 * MS, {})],
            },
            "/device:GPU:0": {
                "Stream #7(compute)": [
                    ("warmup_kernel", -5 * MS, 1 * MS, {"hlo_op": "fusion.9"}),
                    ("gemm_k1", 1 * MS, 2 * MS, {"hlo_op": "fusion.1", "correlation_id": 3}),
                    ("loop_k2", 2 * MS, 2 * MS, {"hlo_op": "fusion.2", "kernel_details": "g"}),
                    ("gemm_k3", 11 * MS, 1 * MS, {"hlo_op": "fusion.1"}),
                ],
                "Stream #9(nccl)": [("ncclDevKernel_AllReduce", 3.5 * MS, 1.5 * MS, ar)],
                "Stream #11(memcpy)": [("MemcpyD2D", 11.5 * MS, 1.5 * MS, {})],
                # a derived line and the profiler's own: kept in the fixture, not kernels
                "XLA Ops": [("fusion.1", 1 * MS, 2 * MS, {"hlo_op": "fusion.1"})],
                "CUPTI overhead": [("CUPTI overhead", 6 * MS, 2 * MS, {})],
            },
            "/host:metadata": {"m": [("meta", 0, 1, {})]},
        },
    )


def test_truth_is_the_union_of_kernels_per_step(tmp_path):
    truth = trim(_raw(tmp_path), tmp_path / "out", "t")
    # step 5: k1 [1, 3) u k2 [2, 4) u nccl [3.5, 5) = [1, 5), 3 kernels; the warm-up kernel
    # started before the first step and is not in any. Step 6: k3 [11, 12) u copy [11.5, 13).
    assert truth["steps"] == [5, 6]
    assert truth["devices"]["0"] == [
        {"step": 5, "kernels": 3, "busy_s": pytest.approx(4e-3)},
        {"step": 6, "kernels": 2, "busy_s": pytest.approx(2e-3)},
    ]
    assert json.loads((tmp_path / "out" / "t.truth.json").read_text())["devices"] == {
        "0": truth["devices"]["0"]
    }


def test_trimmed_trace_keeps_the_device_and_the_steps_only(tmp_path):
    trim(_raw(tmp_path), tmp_path / "out", "t")
    planes = {
        p.name: p for p in ProfileData.from_file(str(tmp_path / "out" / "t.xplane.pb")).planes
    }
    assert set(planes) == {"/host:CPU", "/device:GPU:0"}
    host = [(e.name, dict(e.stats)) for line in planes["/host:CPU"].lines for e in line.events]
    assert host == [("train", {"step_num": 5}), ("train", {"step_num": 6})]
    device = {
        line.name: [
            (e.name, e.start_ns / MS, e.duration_ns / MS, dict(e.stats)) for e in line.events
        ]
        for line in planes["/device:GPU:0"].lines
    }
    assert device["Stream #7(compute)"] == [
        ("gemm_k1", 1, 2, {"hlo_op": "fusion.1", "correlation_id": 3}),
        ("loop_k2", 2, 2, {"hlo_op": "fusion.2", "kernel_details": "g"}),
        ("gemm_k3", 11, 1, {"hlo_op": "fusion.1"}),
    ]
    assert set(device) == {
        "Stream #7(compute)",
        "Stream #9(nccl)",
        "Stream #11(memcpy)",
        "XLA Ops",
        "CUPTI overhead",
    }


def test_a_trace_without_steps_or_gpu_is_refused(tmp_path):
    f = write(tmp_path / "a.xplane.pb", {"/device:GPU:0": {"Stream #1": [("k", 0, MS, {})]}})
    with pytest.raises(SystemExit, match="no step annotations"):
        trim(f, tmp_path / "out", "t")
    f = write(
        tmp_path / "b.xplane.pb",
        {"/host:CPU": {"python": [("train", 0, MS, {"step_num": 1})]}, "/device:TPU:0": {}},
    )
    with pytest.raises(SystemExit, match="trims GPU traces"):
        trim(f, tmp_path / "out", "t")
