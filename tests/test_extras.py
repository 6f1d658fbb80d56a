"""Every command that needs an optional extra, run where that extra is absent: ONE line on
stderr naming the extra and its install command, exit 2, and nothing done before it (no plan
printed, nothing compiled). The extra's packages are hidden from the import system
(tests/extras.py), so these run in every environment, with or without the extras installed.

Each is a fresh process (~3 s of start-up, most of a case): the quick loop keeps one, the
others are slow."""

import pytest

from tests.extras import cli_without, needs_gpu_aot, needs_tpu

GPU_AOT = "pip install 'jaxdist[gpu-aot]'"
TPU = "pip install 'jaxdist[tpu]'"
CASES = [
    pytest.param("gpu-aot", ["train", "--compile-only", "--target", "h100:8"], id="train-h100"),
    # The plan itself is cheap, but a user who asked for XLA's figures gets none without the
    # compiler: told at once, not after the table (nor on fake CPU devices, which cannot run
    # the GPU's fused attention).
    pytest.param(
        "gpu-aot",
        ["plan", "--devices", "16", "--hardware", "h100-ib", "--verify", "1"],
        id="plan-h100",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "tpu",
        ["train", "--compile-only", "--target", "tpu-v5p:2x2x1"],
        id="train-tpu",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "tpu",
        ["plan", "--devices", "4", "--hardware", "tpu-v5p", "--verify", "1"],
        id="plan-tpu",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("extra", "args"), CASES)
def test_a_command_that_needs_an_absent_extra_says_which_in_one_line(extra, args):
    r = cli_without(extra, args[0], "--model", "tiny", *args[1:])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1, r.stderr[-3000:]
    assert {"gpu-aot": GPU_AOT, "tpu": TPU}[extra] in lines[0]
    assert r.stdout == ""


@pytest.mark.slow
def test_without_the_extra_a_bad_target_is_still_told_first():
    # The flag's own mistake comes before the missing extra: fixing it is the user's first step.
    r = cli_without("gpu-aot", "train", "--model", "tiny", "--compile-only", "--target", "h100:9")
    assert r.returncode == 2 and "h100:N" in r.stderr and "gpu-aot" not in r.stderr


@needs_tpu
@needs_gpu_aot
def test_a_tpu_target_starts_no_cuda_plugin_on_a_host_without_gpus():
    # Both extras installed, no JAX_PLATFORMS (a TPU VM's shell): compiling for a topology
    # started every plugin, and CUDA's printed a traceback ("Unable to load cuFFT").
    import os
    import subprocess
    import sys

    code = (
        "import jax; from jaxdist.compiled.tpu import tpu_devices; "
        "print(len(tpu_devices('v5p:2x2x1')), jax.default_backend())"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["4", "cpu"]
    assert "Traceback" not in done.stderr and "cuFFT" not in done.stderr, done.stderr
