"""Every flag of every command says what it does: the parsers are walked, not their printed
help (a wrapped line would hide a flag from a reader of the text)."""

import argparse
import re

import pytest
import tyro

from jaxdist.cli.main import COMMANDS, INT_LISTS
from jaxdist.cli.main import command as load_command


def _undescribed(parser: argparse.ArgumentParser) -> list[str]:
    """Flags whose help holds nothing but their default, through every nested subparser."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _undescribed(sub)
        elif action.option_strings and action.help != argparse.SUPPRESS:
            plain = re.sub(r"\x1b\[[0-9;]*m", "", action.help or "")  # rich's colours
            if not re.sub(r"\(default[^)]*\)", "", plain).strip():
                out.append(action.option_strings[0])
    return [flag for flag in out if flag not in ("-h", "--help")]


# tyro.extras.get_parser is deprecated in tyro 1.0 (pinned) without a replacement that returns
# the parser; the flags are read from argparse's own actions.
@pytest.mark.filterwarnings("ignore:get_parser\\(\\) is deprecated:DeprecationWarning")
@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_is_described(command):
    with INT_LISTS:
        parser = tyro.extras.get_parser(load_command(command)[0])
    assert _undescribed(parser) == []


@pytest.mark.filterwarnings("ignore:get_parser\\(\\) is deprecated:DeprecationWarning")
@pytest.mark.parametrize("command", COMMANDS)
def test_every_positional_is_named_for_what_it_is_not_its_type(command):
    # `jaxdist goodput --help` showed `[-h] STR`: a positional named by its field (RUN_DIR).
    with INT_LISTS:
        parser = tyro.extras.get_parser(load_command(command)[0])
    shown = [a.metavar or a.dest for a in parser._actions if not a.option_strings]
    assert not [m for m in shown if m in ("STR", "INT", "FLOAT", "PATH|STR")], shown


def _help(capsys, monkeypatch, columns: int, *argv: str) -> str:
    """`jaxdist *argv --help` as printed at `columns` wide."""
    from jaxdist.cli.main import main

    monkeypatch.setenv("COLUMNS", str(columns))
    # As a terminal or a pipe shows it: tyro draws its boxes in ASCII on a stdout whose encoding
    # is not spelled "utf-8" (pytest's capture says "UTF-8").
    monkeypatch.setattr("tyro._fmtlib._FORCE_UTF8_BOXES", True)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _panels(text: str) -> dict[str, list[str]]:
    """The help's panels (title without tyro's " options") and the flags each lists."""
    panels, current = {}, None
    for line in text.splitlines():
        title = re.match(r"╭─ (?:(.+?) )?options ─", line)
        if title:
            current = panels.setdefault(title.group(1) or "", [])
        elif current is not None and re.match(r"│ --?\w", line):
            current.append(line[2:].split()[0])
    return panels


@pytest.mark.filterwarnings("ignore:get_parser\\(\\) is deprecated:DeprecationWarning")
@pytest.mark.parametrize("command", ["train", "plan", "comm", "bench"])
def test_help_groups_every_flag_by_concern(command, capsys, monkeypatch):
    from jaxdist.cli.help_groups import COMMANDS as GROUPED

    wanted = GROUPED[f"jaxdist {command}"]
    panels = _panels(_help(capsys, monkeypatch, 80, command))
    # tyro's "options" panel keeps only -h; every other flag is in its concern's, in order.
    assert panels.pop("") == ["-h,"]
    assert list(panels) == [name for name, _ in wanted]
    for name, flags in wanted:
        assert [f.rstrip(",") for f in panels[name]] == list(flags), name
    # Every flag of the parser has its panel (a new flag needs one here too).
    with INT_LISTS:
        parser = tyro.extras.get_parser(load_command(command)[0])
    listed = {f for _, flags in wanted for f in flags}
    assert {a.option_strings[0] for a in parser._actions if a.option_strings} - listed == {"-h"}


def test_a_help_text_is_one_paragraph_however_its_docstring_was_wrapped(capsys, monkeypatch):
    # tyro broke a docstring's text wherever its source line was indented, mid-sentence
    # ("(RMSNorm, SwiGLU," then "RoPE); ..." a line down). Wrapped as one paragraph, a line ends
    # only where the next word would not fit: 70 columns inside an 80-column panel.
    lines = _help(capsys, monkeypatch, 80, "train").splitlines()
    described = [re.match(r"│       (\S.*?)\s*│$", line) for line in lines]
    early = [
        this.group(1)
        for this, after in zip(described, described[1:], strict=False)
        if this and after and len(this.group(1)) + 1 + len(after.group(1).split()[0]) <= 70
    ]
    assert early == []
    assert any("(RMSNorm, SwiGLU, RoPE)" in line for line in lines)


def _entries(text: str) -> dict[str, str]:
    """Each flag's help as one line: its row and the description rows under it."""
    out, flag = {}, None
    for line in text.splitlines():
        row = re.match(r"│ (-\S+)(.*?)│?$", line)
        if row:
            flag = row.group(1).rstrip(",")
            out[flag] = row.group(2)
        elif flag is not None and line.startswith("│"):
            out[flag] += " " + line.strip("│ ")
        else:
            flag = None
    return {k: " ".join(v.split()) for k, v in out.items()}


@pytest.mark.parametrize("command", ["train", "plan", "eval", "export-hf"])
def test_a_flag_whose_text_names_its_default_shows_one_default(capsys, monkeypatch, command):
    # "--kv-heads ... (default: --heads) (default: None)": tyro's None said nothing the text
    # had not said better. A text that names its default keeps only its own.
    entries = _entries(_help(capsys, monkeypatch, 100, command))
    assert len(entries) > 5  # the help was read
    twice = {f: e for f, e in entries.items() if re.search(r"default:.*\(default: None\)", e)}
    assert twice == {}


# What a command line loads before it answers: its flags are plain values (jaxdist.layout,
# jaxdist.config, the presets' names), and what runs is imported when it runs. In a fresh
# interpreter, as a user's shell starts one. (Times, side by side with `import jax`, are in
# experiments/README.md: a timed test would measure this host, not the code.)
LOADED = """
import contextlib, io, sys
from jaxdist.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(sys.argv[1:])
heavy = ("jax", "jaxlib", "flax", "optax", "grain", "orbax.checkpoint", "tensorstore")
print(len(out.getvalue()), *sorted(m for m in heavy if m in sys.modules))
"""


@pytest.mark.parametrize(
    "argv", [["--version"], ["train", "--help"], ["eval", "--help"], ["tokenize", "--help"]]
)
def test_a_command_line_answers_without_loading_jax(argv):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, check=True
    )
    printed, *loaded = done.stdout.split()
    assert int(printed) > 0 and loaded == [], f"{' '.join(argv)} loaded {loaded}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_defaults_read_as_values(capsys, monkeypatch, command):
    # tyro showed about 40 flags as `--layers {None}|INT ... (default: None)`: None is no value
    # a user types or reads. An unset flag reads as what it means (the preset's, off).
    text = _help(capsys, monkeypatch, 100, command)
    assert "{None" not in text and "(default: None)" not in text
    assert "(default: False)" not in text and "(default: True)" not in text
    if command == "train":
        entries = _entries(text)
        assert (
            entries["--layers"].startswith("INT ")
            and "(default: the preset's)" in entries["--layers"]
        )
        assert entries["--profile"].endswith("(default: off)")
        assert entries["--document-mask"].endswith("(default: on)")


def test_the_mesh_flag_names_its_axes_and_terms_of_art_are_explained(capsys, monkeypatch):
    from jaxdist.layout import MESH_AXES

    entries = _entries(_help(capsys, monkeypatch, 100, "train"))
    mesh = entries["--mesh"]
    assert all(re.search(rf"\b{axis} \(", mesh) for axis in MESH_AXES), mesh
    # Each term of art with the sentence that says what it is.
    said = {
        "--checkpoint-every": ("Young-Daly's interval, sqrt(2 x save cost x MTBF)", "MTBF (mean"),
        "--mtbf-hours-per-device": ("MTBF, mean time between failures",),
        "--pipeline-schedule": ("1f1b (one forward, one backward", "gpipe (every microbatch"),
        "--sync-every": ("H in the DiLoCo papers",),
        "--sync-fragments": ("F in Streaming DiLoCo",),
        "--sync-delay": ("T in Streaming DiLoCo",),
    }
    for flag, sentences in said.items():
        assert all(s in entries[flag] for s in sentences), (flag, entries[flag])


# Bad flags as a script reads them: one line on stderr, in jaxdist's words, naming the
# command's own help, exit code 2 (tyro drew a 6-9-line box pointing at the help).
@pytest.mark.parametrize(
    "argv, line",
    [
        (["train", "--fp8", "bogus"], "--fp8 'bogus' is not one of off, current, delayed"),
        (["train", "--steps", "x"], "--steps 'x' is not an integer"),
        (["plan", "--link-gbps", "fast"], "--link-gbps 'fast' is not a number"),
        (["train", "--stepz", "3"], "unknown option --stepz (did you mean --steps?)"),
        (["train", "--mesh"], "--mesh needs a value"),
        (["trian"], "unknown command trian (did you mean train?)"),
        (["eval"], "jaxdist eval needs RUN_DIR"),
        (["goodput"], "jaxdist goodput needs RUN_DIR"),
        (["export-hf", "runs/a"], "jaxdist export-hf needs OUT_DIR"),
        (["slurm", "--nodes", "two", "--", "train"], "--nodes 'two' is not an integer"),
        (["train", "--remat", "most"], "--remat 'most' is not one of auto, preset, none, full"),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_commands_help(capsys, argv, line):
    from jaxdist.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == ""
    (said,) = err.splitlines()
    prog = "jaxdist" if argv[0] == "trian" else f"jaxdist {argv[0]}"
    assert said.startswith(f"jaxdist: error: {line}") and said.endswith(f"; see {prog} --help")
