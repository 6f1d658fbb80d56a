"""Shared builders for tests: compiled steps for a layout, and the command line."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax

from jaxdist.config import OptimConfig
from jaxdist.layout import Layout, StepConfig
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.metrics.records import latest_per_step, read_metrics
from jaxdist.optim import make_optimizer
from jaxdist.step import build
from meshes.presets import STANDARD_RULES, get_mesh_preset
from models.inventory import plan_model
from models.presets import get_model_config
from models.transformer import Transformer


def planned(name: str, dtype: str = "bfloat16", **over):
    """A model preset as the planner takes it (its inventory of weights and FLOPs)."""
    return plan_model(get_model_config(name, compute_dtype=dtype, **over))


def mesh_for(layout: str):
    if layout == "single":
        return build_mesh(get_mesh_preset("single").mesh, jax.devices()[:1])
    return build_mesh(parse_mesh(layout))


def compiled_for(
    layout: str,
    model: str = "tiny",
    batch_size: int = 16,
    microbatches: int = 1,
    steps: int = 10,
    **model_overrides,
):
    mc = get_model_config(model, **model_overrides)
    mesh = mesh_for(layout)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), steps)
    step = StepConfig(microbatches)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch_size, seq_len=mc.seq_len)
    jitted = build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)
    return mc, mesh, jitted


# --- the command line, as the subprocess tests run it: every test builds it here ---
JAXDIST = [sys.executable, "-m", "jaxdist.cli"]
# Read after conftest.py pointed the caches at the session's temporary directory.
CLI_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def tiny_train(steps: int, checkpoint_every: int) -> list[str]:
    """`train` for the tiny model on the cpu8 layout, logging every step."""
    return [
        "train",
        "--model",
        "tiny",
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--log-every",
        "1",
        "--checkpoint-every",
        str(checkpoint_every),
    ]


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`jaxdist *args`, run to the end; stdout and stderr captured as text. `env`: variables
    set over the suite's (CLI_ENV)."""
    return subprocess.run(
        [*JAXDIST, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**CLI_ENV, **(env or {})},
    )


def cli_popen(*args: str, merge_output: bool = True) -> subprocess.Popen:
    """`jaxdist *args`, started in the background (for the tests that signal or kill it)."""
    return subprocess.Popen(
        [*JAXDIST, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        env=CLI_ENV,
    )


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    """Step -> loss, the last logged line of each step winning (as after a resume)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    return {s: r["loss"] for s, r in latest_per_step(records).items()}


def load_experiment(name: str):
    """experiments/NAME.py as a module: the studies are scripts, not a package the library or
    the tests import by name."""
    path = pathlib.Path(__file__).resolve().parent.parent / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# DeepSeek-V3's router at a tiny size: sigmoid scores, 4 groups of 2 experts of which a token's
# choice spans the best 2, a selection bias moved at 0.01 a step, one shared expert, weights
# scaled by 2.5 (tests/test_routing.py, tests/test_dense_layers.py).
DEEPSEEK_ROUTER = dict(
    scoring="sigmoid",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    router_bias=True,
    bias_update_rate=0.01,
    n_shared_experts=1,
)
