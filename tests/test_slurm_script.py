"""The sbatch script's restart loop, run by bash with a fake `srun` on PATH: no cluster needed.

The fake srun plays back a list of attempts (what srun prints on stderr, its exit code), as the
real one reports them; tests/test_slurm.py runs the same loop under a real Slurm."""

import os
import stat
import subprocess
import time

import pytest

from jaxdist.cluster import manifests, restarts
from jaxdist.errors import ConfigError
from jaxdist.metrics.goodput import read_restarts

TRAIN = ["train", "--model", "tiny", "--steps", "6"]
# What the real srun prints when one of two tasks dies, and the others are stopped for it.
KILLED_1 = "srun: error: vm: task 1: Killed\nsrun: error: vm: task 0: Terminated"


def fake_srun(tmp_path, attempts: list[tuple[str, int]], term_parent: bool = False) -> str:
    """A directory holding `srun`: its call k (from 1) prints attempts[k-1]'s text on stderr and
    exits with its code (the last one repeats); each call's arguments are a line of CALLS."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    arms = "".join(
        f"  {k}) printf '%s\\n' {_sq(text)} >&2; exit {code} ;;\n"
        for k, (text, code) in enumerate(attempts[:-1], start=1)
    )
    last_text, last_code = attempts[-1]
    srun = bindir / "srun"
    srun.write_text(
        "#!/bin/bash\n"
        'echo "$*" >>"$CALLS"\n'
        'echo "a task\'s output"\n'
        'echo "a task\'s log line" >&2\n'
        + ('kill -TERM "$PPID"\n' if term_parent else "")
        + 'case $(wc -l <"$CALLS") in\n'
        + arms
        + f"  *) printf '%s\\n' {_sq(last_text)} >&2; exit {last_code} ;;\n"
        + "esac\n"
    )
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    return str(bindir)


def _sq(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def run_script(tmp_path, script: str, bindir: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "CALLS": str(tmp_path / "calls"),
        "SLURM_JOB_NAME": "job",
        "SLURM_JOB_ID": "77",
    }
    return subprocess.run(
        ["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


def calls(tmp_path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_rendered_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(manifests.sbatch(2, 8, TRAIN, max_restarts=2))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_killed_task_is_restarted_and_recorded(tmp_path):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)], max_restarts=2)
    before = time.time()
    r = run_script(tmp_path, script, fake_srun(tmp_path, [("", 137), ("", 0)]))
    after = time.time()
    assert r.returncode == 0, r.stderr
    assert len(calls(tmp_path)) == 2
    for call in calls(tmp_path):
        assert call.startswith("--kill-on-bad-exit=1 python -m jaxdist.cli train --model tiny")
        assert call.endswith(f"--run-dir {run_dir}") and call.count("--run-dir") == 1
    # The tasks' output and logs still reach the job's output, both attempts'.
    assert r.stdout.count("a task's output") == 2 and r.stderr.count("a task's log line") == 2
    cause = "srun exited 137 (a task killed by SIGKILL)"
    assert f"jaxdist: attempt 1: {cause}; restart 1 of 2\n" in r.stderr
    (rec,) = read_restarts(run_dir)
    assert {k: rec[k] for k in ("restart", "max_restarts", "cause", "by")} == {
        "restart": 1,
        "max_restarts": 2,
        "cause": cause,
        "by": "slurm",
    }
    assert before <= rec["time"] <= after


def test_restarts_run_out(tmp_path):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)], max_restarts=1)
    line = "srun: error: vm: task 0: Exited with exit code 3"
    r = run_script(tmp_path, script, fake_srun(tmp_path, [(line, 3)]))
    assert r.returncode == 3
    assert len(calls(tmp_path)) == 2
    cause = "srun exited 3 (task 0 exited with code 3)"
    assert [x["cause"] for x in read_restarts(run_dir)] == [cause]
    assert f"jaxdist: attempt 2: {cause}; not restarted: no restarts left of 1\n" in r.stderr


@pytest.mark.parametrize(
    "report, cause",
    [
        # --kill-on-bad-exit stops the others with SIGTERM, so srun's own code is 143: the
        # cause is the task srun reported first.
        (KILLED_1, "srun exited 143 (task 1 killed by SIGKILL)"),
        (
            "srun: error: vm: task 0: Exited with exit code 124\n"
            "srun: error: vm: task 1: Terminated",
            "srun exited 143 (task 0 exited 124: a hang was declared)",
        ),
        ("srun: error: vm: tasks 0-1: Killed", "srun exited 143 (tasks 0-1 killed by SIGKILL)"),
        # Another signal, in srun's words (quotes and a backslash to test the JSON's escapes).
        (
            'srun: error: vm: task 1: Segmentation fault "x" \\',
            'srun exited 143 (task 1: Segmentation fault "x" \\)',
        ),
    ],
)
def test_the_cause_is_the_first_task_srun_reports(tmp_path, report, cause):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, f"--run-dir={run_dir}"], max_restarts=3)
    r = run_script(tmp_path, script, fake_srun(tmp_path, [(report, 143), ("", 0)]))
    assert r.returncode == 0, r.stderr
    assert [x["cause"] for x in read_restarts(run_dir)] == [cause]


def test_srun_failing_on_its_own_is_told_apart(tmp_path):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)], max_restarts=1)
    report = "srun: error: Unable to create step for job 77: Job has been cancelled"
    r = run_script(tmp_path, script, fake_srun(tmp_path, [(report, 1), ("", 0)]))
    assert r.returncode == 0, r.stderr
    (rec,) = read_restarts(run_dir)
    assert rec["cause"] == "srun exited 1 (no task's failure reported: srun's own error, above)"


def test_the_default_run_dir_is_the_jobs(tmp_path):
    script = manifests.sbatch(1, 0, TRAIN, max_restarts=1)
    r = run_script(tmp_path, script, fake_srun(tmp_path, [("", 137), ("", 0)]))
    assert r.returncode == 0, r.stderr
    assert all(c.endswith("--run-dir runs/job-77") for c in calls(tmp_path))
    assert [x["restart"] for x in read_restarts(tmp_path / "runs" / "job-77")] == [1]


def test_a_sigterm_is_not_restarted(tmp_path):
    # A task stopped by SIGTERM (the time limit's signal reaching one late, a preemption):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)], max_restarts=2)
    report = "srun: error: vm: task 1: Terminated"
    r = run_script(tmp_path, script, fake_srun(tmp_path, [(report, 143), ("", 0)]))
    assert r.returncode == 143
    assert len(calls(tmp_path)) == 1 and read_restarts(run_dir) == []
    assert "not restarted: a SIGTERM asks to stop" in r.stderr


def test_a_sigterm_to_the_script_ends_the_loop(tmp_path):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)], max_restarts=2)
    bindir = fake_srun(tmp_path, [(KILLED_1, 137), ("", 0)], term_parent=True)
    r = run_script(tmp_path, script, bindir)
    assert r.returncode == 137
    assert len(calls(tmp_path)) == 1 and read_restarts(run_dir) == []


def test_without_restarts_the_script_runs_srun_once(tmp_path):
    run_dir = tmp_path / "run"
    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(run_dir)])
    assert "while" not in script and "RUN_DIR" not in script
    assert script.splitlines()[-1].startswith("srun --kill-on-bad-exit=1 python -m jaxdist.cli")
    r = run_script(tmp_path, script, fake_srun(tmp_path, [("", 137), ("", 0)]))
    assert r.returncode == 137
    assert len(calls(tmp_path)) == 1 and not (run_dir / restarts.FILE).exists()


def test_negative_max_restarts_is_refused():
    with pytest.raises(ConfigError, match="--max-restarts -1"):
        manifests.sbatch(1, 0, TRAIN, max_restarts=-1)


def test_the_tasks_run_the_environment_the_script_was_printed_from(tmp_path):
    # The script ran whatever `python` the nodes' PATH held. It now activates the environment
    # `jaxdist slurm` ran in: srun starts that environment's python, whatever the PATH was.
    import sys

    script = manifests.sbatch(1, 0, [*TRAIN, "--run-dir", str(tmp_path / "run")])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text('#!/bin/bash\ncommand -v "$2" >"$CALLS"\n')  # srun --kill-on-bad-exit=1 python
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    venv = os.path.dirname(sys.executable)
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{bare}", "CALLS": str(tmp_path / "calls")}
    env.pop("VIRTUAL_ENV", None)
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text().strip() == os.path.join(sys.prefix, "bin", "python")
    assert "# Each task runs jaxdist from the environment `jaxdist slurm` ran in" in script


def test_another_environment_is_activated_as_its_kind_is(tmp_path):
    (tmp_path / "conda" / "conda-meta").mkdir(parents=True)
    conda = manifests.activation(str(tmp_path / "conda"))
    assert conda[-1] == f'eval "$(conda shell.bash hook)" && conda activate {tmp_path}/conda'
    with pytest.raises(ConfigError, match="holds no bin/activate"):
        manifests.activation(str(tmp_path))
