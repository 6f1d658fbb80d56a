"""Every command block of README.md, run as written in a fresh clone of HEAD, as a new user
would: exit 0, the result on stdout, and no warning on stderr that the README does not explain.

A fresh clone, not this checkout: a file the README needs but git does not hold (a fixture,
data, a run directory left over) fails here. The clone's own code runs (PYTHONPATH), through the
venv's `jaxdist` entry point (the venv's bin first on PATH, as `source .venv/bin/activate`
does). The blocks run in README order in one clone, so later commands find what earlier ones
wrote (tokenize, then train, then eval; a run, then its profile, checkpoints and goodput).
Every command runs unless SKIP names it with the reason; a command added to the README later
runs by default. 14 to 16 minutes (838 s, 954 s) on a two-core host shared with other jobs,
most of it training (-m experiment)."""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The README's shell blocks start with one of these (python3.12 too) or with an assignment
# (M=...); any other block is a Python program.
SHELL_WORDS = ("jaxdist", "python", "pip", "tensorboard")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")

# Commands this CPU-only test cannot run, by how they start (whitespace collapsed), and why.
SKIP = {
    # Makes the venv and installs into it: this test runs inside that environment already.
    "python3.12 -m venv .venv": "the environment it creates is the one running this test",
    # The suite itself (this file is in it).
    "python -m pytest -q": "the test suite, which runs this test",
    # A server that runs until it is stopped; the event files it reads are checked by
    # tests/test_wandb.py and the TensorBoard tests.
    "tensorboard --logdir": "a server that runs until stopped",
    # PATH stands for the user's own Hugging Face model directory.
    "jaxdist train --model hf:PATH": "hf:PATH is a placeholder for a model directory",
}

# Paths outside the repository that a command names, redirected into the test's directory:
# the README's node-local tier on tmpfs would otherwise outlive the test, and a second run of
# the test would find the first one's shards there.
REDIRECT = {"/dev/shm/jaxdist": "{tmp}/shm-jaxdist"}

# Warnings the README explains, as (pattern on a stderr line, the README's words that explain
# it, checked to be there). Any other stderr line holding "warning" fails the command.
_PROFILE = "a `warning:` for exposed communication or the"  # "Profile a step"
EXPLAINED_WARNINGS: list[tuple[str, str]] = [
    # The profile's early warnings (jaxdist/profiling/report.py): 8 fake devices on threads
    # sharing the host's cores wait in their collectives, which is what these name.
    (r"^warning: exposed communication is \d+% of the step", _PROFILE),
    (r"^warning: waiting for peers \(sync\) is \d+% of the step", _PROFILE),
    (r"^warning: step time p90 .* is over 1\.5x p50", "p90 step time over 1.5x p50"),
    (r"^warning: projection: at \d+ devices exposed communication would exceed", _PROFILE),
]


def readme_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """The README's indented code blocks: (first line number, section title, lines)."""
    blocks, section, current, start, previous = [], "", [], 0, ""
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        indented = line.startswith("    ")
        if current and (indented or not line.strip()):
            current.append(line[4:])
            continue
        if current:
            while current and not current[-1].strip():
                current.pop()
            blocks.append((start, section, current))
            current = []
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        # Markdown's code block starts after a blank line (else it continues the paragraph).
        if indented and not previous.strip():
            current, start = [line[4:]], number
        previous = line
    return blocks


def commands(lines: list[str]) -> list[str]:
    """A shell block's commands, each with its backslash-continued lines."""
    out, pending = [], []
    for line in lines:
        if not line.strip():
            continue
        pending.append(line)
        if not line.rstrip().endswith("\\"):
            out.append("\n".join(pending))
            pending = []
    return out


def one_line(command: str) -> str:
    return " ".join(command.replace("\\\n", " ").split())


def skipped(command: str) -> str | None:
    flat = one_line(command)
    return next((why for start, why in SKIP.items() if flat.startswith(start)), None)


def unexplained_warnings(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if "warning" in line.lower()
        # launch's `[pN] ` prefix aside: a process's warning reads the same under launch
        and not any(
            re.search(pattern, re.sub(r"^\[p\d+\] ", "", line)) for pattern, _ in EXPLAINED_WARNINGS
        )
    ]


def tail(text: str, n: int = 15) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-n:])


@pytest.mark.experiment
def test_every_readme_command_runs_as_written(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # The venv's jaxdist is an editable install of this checkout: the clone's code instead.
        "PYTHONPATH": str(clone),
    }
    # conftest.py sets these for the suite's own processes; a new user's shell has neither.
    # The compile and font caches it points at the session's directory stay: they keep the
    # user's home untouched and change no output.
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)

    ran, skips, failures = [], [], []

    def run(shown: str, argv: list[str]) -> None:
        t0 = time.perf_counter()
        p = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        ran.append((time.perf_counter() - t0, shown))
        problems = []
        if p.returncode != 0:
            problems.append(f"exit {p.returncode}")
        if not p.stdout.strip():
            problems.append("nothing on stdout")
        warned = unexplained_warnings(p.stderr)
        if warned:
            problems.append("unexplained warnings:\n" + tail("\n".join(warned)))
        if problems:
            failures.append(
                f"$ {shown}\n  " + "; ".join(problems)
                + f"\n  stdout (tail):\n{tail(p.stdout)}\n  stderr (tail):\n{tail(p.stderr)}"
            )  # fmt: skip

    text = (ROOT / "README.md").read_text()
    # An explanation dropped from the README takes its warning off the allowed list.
    flat = " ".join(text.split())
    assert [words for _, words in EXPLAINED_WARNINGS if words not in flat] == []
    for number, section, lines in readme_blocks(text):
        first = lines[0].split()[0]
        if not first.startswith(SHELL_WORDS) and not ASSIGNMENT.match(first):
            # The Python program (the own-model example), run as a script from the clone.
            script = tmp_path / f"readme_line_{number}.py"
            script.write_text("\n".join(lines) + "\n")
            run(f"python <README line {number}, {section}>", [sys.executable, str(script)])
            continue
        assignments = []  # a block's `M=...` lines, in force for its later commands
        for command in commands(lines):
            if ASSIGNMENT.match(command.strip()):
                assignments.append(command.strip())
                continue
            why = skipped(command)
            if why:
                skips.append(f"{one_line(command)}  ({why})")
                continue
            for path, into in REDIRECT.items():
                command = command.replace(path, into.format(tmp=shlex.quote(str(tmp_path))))
            script = "\n".join([*assignments, command])
            run(one_line(command), ["bash", "-e", "-o", "pipefail", "-c", script])

    timings = "\n".join(f"{seconds:7.1f} s  {shown}" for seconds, shown in ran)
    print(f"ran {len(ran)} commands:\n{timings}\nskipped:\n" + "\n".join(skips))
    assert len(ran) > 20  # the parser found the README's blocks
    assert not failures, f"{len(failures)} of {len(ran)} README commands failed:\n\n" + (
        "\n\n".join(failures)
    )
    # What the commands wrote (data, runs, exports) is no change to the clone for git.
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True)
    assert status.stdout.decode() == ""


def test_what_the_readme_commands_write_is_ignored_by_git():
    # `git status` after the README's commands listed data/ and exported/ as new files.
    outputs = []
    for _, _, lines in readme_blocks((ROOT / "README.md").read_text()):
        first = lines[0].split()[0]
        if not first.startswith(SHELL_WORDS) and not ASSIGNMENT.match(first):
            continue  # the Python program
        for command in commands(lines):
            argv = shlex.split(one_line(command), comments=True)
            flags = zip(argv, argv[1:], strict=False)
            outputs += [b for a, b in flags if a in ("--out", "--run-dir")]
            if argv[:2] == ["jaxdist", "export-hf"]:
                outputs.append(argv[3])
    # Directories, each (a trailing / tells git so); those outside the checkout left out.
    outputs = [p.rstrip("/") + "/" for p in outputs if not p.startswith("/")]
    assert {"data/mine/", "exported/"} <= set(outputs)  # the README was read
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    # --no-index: whether .gitignore ignores the path, tracked or not, existing or not.
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *outputs],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.stderr == ""
    unmatched = [line.split("\t")[1] for line in done.stdout.splitlines() if line.startswith("::")]
    assert unmatched == []
