"""The command line, as a user runs it: outputs on success, one clear line on bad input.

The commands run in this process (main(), output read with capsys): the 8 fake CPU devices are
those tests/conftest.py started, and `--compile-cache off` leaves its process-wide cache as it
is. Only the target compile, which must start with no persistent cache at all, is a process
of its own."""

import importlib
import json
import math
import re
import shlex

import pytest

from jaxdist.cli import cmd_goodput, cmd_train
from jaxdist.cli.main import main
from jaxdist.mesh import devices_hint
from jaxdist.planning import hostfit
from tests.extras import needs_gpu_aot
from tests.helpers import cli


def jaxdist(capsys, *args: str) -> tuple[int, str, str]:
    """`jaxdist *args` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # only this command's output
    rc = main([*args, "--compile-cache", "off"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_train_writes_config_metrics_and_summary(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, out, err = jaxdist(
        capsys,
        "train",
        "--model",
        "tiny",
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--devices",
        "cpu:8",
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--seed",
        "0",
        "--log-every",
        "1",
        "--run-dir",
        str(run_dir),
    )
    assert rc == 0, err
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if "event" not in x]  # checkpoint-interval and profile events
    assert [x["step"] for x in lines] == list(range(6))
    for rec in lines:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "mfu"} <= set(rec)
        # 16 rows of 128 tokens a step, whatever the step took.
        assert rec["tokens_per_s"] * rec["step_time_s"] == pytest.approx(16 * 128)
        assert math.isfinite(rec["loss"])
    # Untrained, the model guesses near uniformly over the 256 byte values.
    assert lines[0]["loss"] == pytest.approx(math.log(256), abs=0.25)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mesh"] == {
        "replica": 1,
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    assert config["model"]["name"] == "tiny" and config["devices"]["count"] == 8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["step_time_s"]["n"] == 4
    # Progress on stderr; the result (the summary, the next commands) on stdout.
    assert "loss" in err and "p50" not in err
    # Not a terminal: the plain lines, each with the step of the total; time left once a
    # steady step exists (not while step 0 compiles); no bar, no control characters.
    steps = [x for x in err.splitlines() if re.match(r"step [0-9]/6  loss", x)]
    assert [x.split()[1] for x in steps] == [f"{s}/6" for s in range(6)], err
    assert "left" not in steps[0] and re.search(r"tok/s  [0-9.]+ s left$", steps[2]), steps
    assert "\x1b" not in err and "\r" not in err
    assert "p50" in out and f"jaxdist train --run-dir {run_dir} --steps 12" in out
    # The printed command carries the run's own flags and runs as printed: the run goes on to
    # step 12 on its mesh, from its checkpoint (it once said "(same flags)" and failed, rc 2).
    (further,) = [x for x in out.splitlines() if x.startswith("next: train further")]
    argv = shlex.split(further.partition("  ")[2])
    assert argv[:2] == ["jaxdist", "train"] and "--mesh" in argv and "(same flags)" not in further
    capsys.readouterr()
    assert main(argv[1:]) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12
    assert json.loads((run_dir / "config.json").read_text())["mesh"] == config["mesh"]


@pytest.mark.slow
def test_comm_json(capsys):
    rc, out, err = jaxdist(capsys, "comm", "--model", "tiny", "--mesh", "fsdp=8", "--json")
    assert rc == 0, err
    rows = json.loads(out)["rows"]
    assert {"axis", "kind", "count", "bytes", "expected_bytes", "ratio"} <= set(rows[0])
    gathers = [x for x in rows if x["axis"] == "fsdp" and x["kind"] == "all-gather"]
    assert gathers and abs(gathers[0]["ratio"] - 1) < 0.05


@pytest.mark.slow
def test_compile_only_reports_memory_for_1b_on_8_devices(capsys):
    rc, out, err = jaxdist(
        capsys,
        "train",
        "--model",
        "1b",
        "--mesh",
        "fsdp=8",
        "--devices",
        "cpu:8",
        "--batch-size",
        "8",
        "--compile-only",
        "--json",
        "-",
    )
    assert rc == 0, err
    report = json.loads(out)
    assert report["params"] == 1_015_681_024
    # fp32 params + two Adam moments, split 8 ways: the arguments XLA holds per device.
    state_bytes = 3 * 4 * report["params"] / 8
    assert report["per_device_bytes"]["argument"] == pytest.approx(state_bytes, rel=0.01)
    assert report["per_device_bytes"]["peak_estimate"] > state_bytes


def test_compile_only_says_what_it_compiles_before_xla_starts(capsys):
    rc, out, err = jaxdist(
        capsys, "train", "--model", "tiny", "--devices", "cpu:8", "--compile-only", "--json", "-"
    )
    assert rc == 0, err
    assert json.loads(out)["model"] == "tiny"
    # One line on stderr before the compile (not a terminal: no spinner, no control characters).
    assert err.startswith(
        "compiling tiny's train step for 8 cpu devices (mesh data=2,fsdp=2,tensor=2, batch 16 "
        "x 128, remat none); XLA may take a minute\n"
    ), err
    assert "\x1b" not in err and "\r" not in err


def test_compile_only_spins_on_a_terminal():
    import io
    import types

    from rich.console import Console

    from jaxdist.cli.compile_report import compiling
    from tests.helpers import mesh_for

    buf = io.StringIO()
    args = types.SimpleNamespace(model="tiny", target="v5p-16")
    layout = types.SimpleNamespace(batch_size=16, seq_len=128, remat="full")
    with compiling(
        Console(file=buf, force_terminal=True, width=200), args, mesh_for("fsdp=8"), layout
    ):
        pass
    assert (
        "compiling tiny's train step for v5p-16 (mesh fsdp=8, batch 16 x 128, remat full)"
        in buf.getvalue()
    )
    assert "XLA is compiling tiny for v5p-16" in buf.getvalue()  # the spinner's text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "data=4"], "needs 4 devices but 8 are present"),
        (["--mesh", "dta=8"], "unknown mesh axis 'dta'"),
        (["--mesh", "cpu9"], "unknown mesh 'cpu9'"),
        (["--model", "huge"], "unknown model 'huge'"),
        (["--mesh", "data=8", "--batch-size", "12"], "does not split over the 8 devices"),
        (["--batch-size", "16", "--microbatches", "3"], "not divisible by 3 microbatches"),
        (["--mesh", "tensor=8"], "dimension '(kv_)?heads' of size 4 is not divisible"),
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
        (["--devices", "gpu:2"], "--devices 'gpu:2' is not understood"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--profile", "1:8"], r"past the run's last step 1: use --profile 1:2 or --steps 8"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path, capsys):
    defaults = ["--steps", "2", "--run-dir", str(tmp_path / "run")]
    if "--devices" not in args:
        defaults += ["--devices", "cpu:8"]
    # In this process an exception other than the user's mistake would fail the test itself.
    rc, _, err = jaxdist(capsys, "train", *defaults, *args)
    assert rc == 2
    assert not (tmp_path / "run").exists()  # refused before any output was written
    assert "Traceback" not in err, err
    errors = [x for x in err.splitlines() if x.startswith("jaxdist: error:")]
    assert len(errors) == 1, err
    assert re.search(message, errors[0]), errors[0]


# tiny's training FLOPs per token, 6N + 12LDT, N counted by hand (see the test below).
TINY_FLOPS = 6 * (2 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 256) + 12 * 2 * 128 * 128


# The bench tests' common command: the step program of the train test above (tiny, the default
# layout, batch 16, a run of at most 21 steps: one learning-rate schedule), compiled once for the
# session; two timed steps give a median and a 90th percentile as five do.
BENCH = ["bench", "--model", "tiny", "--devices", "cpu:8", "--mesh", "data=2,fsdp=2,tensor=2"]
BENCH += ["--steps", "2", "--warmup", "1"]


@pytest.mark.slow
def test_bench_prints_one_json_line_with_the_figures(capsys):
    rc, out, err = jaxdist(capsys, *BENCH)
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.strip()]
    out = json.loads(line)
    for key in (
        "model",
        "batch_size",
        "seq_len",
        "tokens_per_s",
        "model_tflops",
        "mfu",
        "step_ms_p50",
        "step_ms_p90",
        "peak_mem_gb",
        "compile_s",
        "loop_overhead",
    ):
        assert key in out, key
    assert out["step_ms_p90"] >= out["step_ms_p50"] > 0
    # 16 rows of 128 tokens in the median step.
    assert out["tokens_per_s"] * out["step_ms_p50"] / 1e3 == pytest.approx(16 * 128)
    # Model FLOP/s follow from the FLOPs formula, tokens/s x (6N + 12LDT), with tiny's N
    # counted here by hand: 2 layers of attention (4 D^2) and MLP (2 D F) and the head (D V), for
    # D = 128, F = 512, V = 256, T = 128.
    assert out["model_tflops"] == pytest.approx(out["tokens_per_s"] * TINY_FLOPS / 1e12, rel=1e-6)
    # No peak FLOP/s is known for a CPU: no MFU is made up, and the output says why.
    assert out["mfu"] is None and out["peak_tflops_per_device"] is None
    assert "--peak-tflops" in out["mfu_note"]


@pytest.mark.slow
def test_bench_mfu_is_against_the_peak_given(capsys):
    rc, out, err = jaxdist(capsys, *BENCH, "--peak-tflops", "0.5")
    assert rc == 0, err
    out = json.loads(out)
    # MFU = model FLOP/s over 8 devices x 0.5 TFLOP/s each, tiny's FLOPs per token by hand.
    assert out["mfu"] == pytest.approx(out["model_tflops"] / (8 * 0.5), rel=1e-9)
    assert out["mfu"] == pytest.approx(out["tokens_per_s"] * TINY_FLOPS / (8 * 0.5e12), rel=1e-6)
    assert out["peak_tflops_per_device"] == 0.5 and "mfu_note" not in out


def test_fault_nan_steps_takes_a_comma_list_as_well_as_spaces(monkeypatch):
    seen = []
    monkeypatch.setattr(cmd_train, "run", lambda args: seen.append(args) or 0)
    for given in (["5,9"], ["5", "9"], ["5,", "9"]):
        assert main(["train", "--fault-nan-steps", *given, "--steps", "3"]) == 0
    assert main(["train", "--fault-nan-steps=5,9"]) == 0
    assert [a.step.fault_nan_steps for a in seen] == [(5, 9)] * 4
    assert seen[0].loop.steps == 3  # the flag after the list is still its own


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "--batch-size", "32"],
        ["train", "--batch-size", "32", "--steps", "1"],
    ],
)
def test_a_step_too_big_for_host_memory_is_refused_before_compiling(
    command, monkeypatch, capsys, tmp_path
):
    # 8 fake devices share the host: gpt2-124m at batch 32 needs tens of GB of it.
    monkeypatch.setattr(hostfit, "available_bytes", lambda: 18_000_000_000)

    def build(*args, **kwargs):
        raise AssertionError("the step was built before the refusal")

    # train and bench both build their step through the loop's module.
    monkeypatch.setattr(importlib.import_module("jaxdist.train"), "build", build)
    run_dir = tmp_path / "run"
    rc = main(
        [
            *command,
            "--model",
            "gpt2-124m",
            "--devices",
            "cpu:8",
            "--compile-cache",
            "off",
            *(["--run-dir", str(run_dir)] if command[0] == "train" else []),
        ]
    )
    assert rc == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(r"needs about \d+\.\d GB of host memory \(8 devices x ", line), line
    assert "but 18.0 GB is available" in line
    # --remat auto already fell back to full, the leanest policy: no use suggesting it.
    assert re.search(r"--batch-size \(\d+ needs \d+\.\d GB\), or a smaller", line)
    assert "--remat" not in line
    assert not run_dir.exists()


def test_the_devices_hint_is_per_process():
    # --devices cpu:N gives each process N devices: 2 processes make a mesh of 8 with cpu:4.
    assert devices_hint(8, 1) == "--devices cpu:8 on a CPU host"
    assert devices_hint(8, 2).startswith("--devices cpu:4 on a CPU host")
    assert "cpu:" not in devices_hint(6, 4).replace("cpu:N", "")


@pytest.mark.slow
@needs_gpu_aot
def test_a_target_compile_leaves_the_persistent_cache_alone(tmp_path):
    # The deviceless GPU compiler cannot load an executable back from the cache (it warned
    # "PjRtCompiler must be constructed with a Client" on every later compile), and nothing
    # runs: the cache is neither written nor read. A process of its own: this one already has
    # the session's cache on. One thin layer of tiny is enough to compile something.
    cache = tmp_path / "xla"
    args = ["train", "--model", "tiny", "--compile-only", "--target", "h200:1"]
    args += ["--layers", "1", "--d-model", "64", "--seq-len", "32", "--batch-size", "8"]
    r = cli(*args, "--compile-cache", str(cache), timeout=600)
    assert r.returncode == 0, r.stderr
    assert not cache.exists() or not any(cache.iterdir())
    assert "persistent compilation cache" not in r.stderr


def test_version_names_jaxdist_and_jax(capsys):
    import jax

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxdist ") and f"(jax {jax.__version__})" in out


@pytest.mark.slow
def test_the_default_mesh_fits_the_devices_present(tmp_path):
    r = cli("train", "--devices", "cpu:4", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "on mesh fsdp=4 x cpu" in r.stderr, r.stderr


# `python -m jaxdist.cli train`, interrupted by Ctrl-C while the command's modules load (JAX's
# take seconds): the signal is sent from an import hook, at the import it would have broken.
_INTERRUPTED_WHILE_LOADING = """
import os, signal, sys, time
sys.argv = ["-m", "train"]  # as `python -m jaxdist.cli train` has it while the package loads
# As a shell starts a command: Ctrl-C is Python's own (a test worker that ran before may pass
# an ignored SIGINT on to its children).
signal.signal(signal.SIGINT, signal.default_int_handler)

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "jaxdist.cli.main":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler runs here
        return None

sys.meta_path.insert(0, Interrupt())
import jaxdist.cli
print("not interrupted")
"""


def test_ctrl_c_while_the_command_loads_is_one_line():
    import subprocess
    import sys

    from jaxdist.cli import STARTING
    from tests.helpers import CLI_ENV

    r = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_WHILE_LOADING],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLI_ENV,
    )
    assert (r.returncode, r.stdout, r.stderr) == (130, "", STARTING.decode())


def test_the_librarys_warnings_print_in_the_house_style(capsys, monkeypatch):
    # A full disk's warning comes from the library's logger (jaxdist.checkpoint), not the
    # CLI's console: printed as the CLI's other lines are, once, on stderr.
    import logging

    def warns(args) -> int:
        logging.getLogger("jaxdist.checkpoint").warning("only %s free", "1 MB")
        return 0

    monkeypatch.setattr(cmd_goodput, "goodput", warns)
    capsys.readouterr()
    assert main(["goodput", "some-run"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("", "jaxdist: warning: only 1 MB free\n")
    assert logging.getLogger("jaxdist").propagate  # as it was, once the command is over


def test_a_refused_resume_names_the_flags_that_changed(tmp_path, capsys):
    # The newest checkpoint's record (as a save writes it) held replica groups meeting every 8
    # steps; resuming at 32 is refused by flag, --sync-every, not by the config's field path.
    meta = tmp_path / "checkpoints" / "3" / "meta"
    meta.mkdir(parents=True)
    record = {"sync": {"sync_every": 8}, "step": {"fp8": "off"}, "model": {"num_layers": 2}}
    (meta / "metadata").write_text(json.dumps({"config": record}))
    # 40 steps: the groups meet (no warning that they never do), the refusal the only line.
    rc, _, err = jaxdist(
        capsys, "train", "--mesh", "replica=2,data=4", "--devices", "cpu:8", "--sync-every", "32",
        "--steps", "40", "--run-dir", str(tmp_path),
    )  # fmt: skip
    assert rc == 2
    # The outer step's line of the header (--outer-lr auto's choice), then the refusal alone.
    header, line = err.splitlines()
    assert header.startswith("outer step: ")
    assert line.startswith(f"jaxdist: error: {tmp_path} holds a checkpoint (step 3)")
    assert "--sync-every 8 -> 32" in line and "sync.sync_every" not in line
    assert "--layers" not in line  # tiny has 2 layers: unchanged, unnamed


def test_the_flags_of_a_config_come_back_as_the_same_config():
    # What `next:` prints is read back by the same parser into the same config: lists, a
    # repeated flag, a negated boolean, a None over a default, a flag with two names (--lr).
    import tyro

    from jaxdist.cli.config_file import command_line, flag_of
    from jaxdist.cli.main import INT_LISTS

    argv = ["--model", "tiny-llama", "--mesh", "replica=2,fsdp=4", "--sync-every", "8"]
    argv += ["--lr", "0.01", "--fault", "kill:3:0", "--fault", "term:5:1", "--remat", "full"]
    argv += ["--fault-nan-steps", "3,4", "--no-document-mask", "--eval-every", "0"]
    argv += ["--checkpoint-every", "4", "--heartbeat-timeout", "50", "--steps", "12"]
    with INT_LISTS:
        given = tyro.cli(cmd_train.Train, args=argv)
        line = command_line(given, skip=("loop.steps",))
        assert "--steps" not in line and line.count("--fault") == 2 and "--lr" in line
        assert tyro.cli(cmd_train.Train, args=[*line, "--steps", "12"]) == given
    assert command_line(cmd_train.Train()) == []
    paths = ("sync.sync_every", "optim.learning_rate", "model.num_layers")
    assert [flag_of(p, cmd_train.Train) for p in paths] == [
        "--sync-every", "--lr", "--layers",
    ]  # fmt: skip
