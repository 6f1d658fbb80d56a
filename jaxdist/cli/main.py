"""`jaxdist`: typed commands (tyro) over the library's own config dataclasses.

The CLI is the one part of jaxdist that imports models/ and meshes/; the core never does. Each
command group has its module here; this one only dispatches and turns a user's mistake
(ConfigError) into one line and exit code 2.
"""

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable

import tyro

from jaxdist.cli import config_file
from jaxdist.cli.cmd_launch import passthrough
from jaxdist.cli.help_groups import grouped, one_line_errors
from jaxdist.errors import ConfigError, TrainingStopped

# Integer lists (--fault-nan-steps) as users type them, `5,9`, as well as tyro's own `5 9`.
INT_LISTS = tyro.constructors.ConstructorRegistry()


@INT_LISTS.primitive_rule
def _int_list(info: tyro.constructors.PrimitiveTypeInfo):
    if info.type != tuple[int, ...]:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs="*",
        metavar="INT[,INT...]",
        instance_from_str=lambda args: tuple(
            int(x) for a in args for x in a.split(",") if x.strip()
        ),
        is_instance=lambda v: isinstance(v, tuple) and all(isinstance(x, int) for x in v),
        str_from_instance=lambda v: [str(x) for x in v],
    )


# name -> (its module in jaxdist.cli, the dataclass of its flags, the function that runs it).
# A command's module loads when the command is named: `jaxdist train --help` parses train's
# flags, plain values, without loading jax or what the other commands run.
COMMANDS = {
    "train": ("cmd_train", "Train", "run"),
    "tokenize": ("cmd_data", "Tokenize", "tokenize"),
    "eval": ("cmd_eval", "Eval", "evaluate"),
    "comm": ("cmd_comm", "Comm", "run"),
    "bench": ("cmd_bench", "Bench", "run"),
    "checkpoints": ("cmd_runs", "Checkpoints", "checkpoints"),
    "goodput": ("cmd_goodput", "Goodput", "goodput"),
    "profile": ("cmd_runs", "Profile", "profile"),
    "plan": ("cmd_plan", "Plan", "run"),
    "export-hf": ("cmd_hf", "ExportHF", "export_hf"),
    "generate": ("cmd_hf", "Generate", "generate"),
}


# The commands that carry a train command line after `--` (cmd_launch), by their flags' class.
PASSTHROUGH = {"launch": "Launch", "slurm": "Slurm", "k8s": "K8s"}


def _flags(kind: type | str) -> list[str]:
    """Every spelling of every flag of a command (a class of cmd_launch's, by name)."""
    if isinstance(kind, str):
        from jaxdist.cli import cmd_launch

        kind = getattr(cmd_launch, kind)
    return [n for flag in config_file.flags_of(kind).values() for n in flag.names]


def command(name: str) -> tuple[type, Callable]:
    """A command's flags (its dataclass) and the function that runs it, its module loaded."""
    module, kind, run = COMMANDS[name]
    loaded = importlib.import_module(f"jaxdist.cli.{module}")
    return getattr(loaded, kind), getattr(loaded, run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        from importlib.metadata import version

        print(f"jaxdist {version('jaxdist')} (jax {version('jax')})")
        return 0
    if argv and argv[0] in PASSTHROUGH:
        try:
            with grouped(), one_line_errors(lambda: _flags(PASSTHROUGH[argv[0]])):
                return passthrough(argv)
        except ConfigError as e:
            print(f"jaxdist: error: {e}", file=sys.stderr)
            return 2

    name = argv[0] if argv and argv[0] in COMMANDS else None
    defaults = None
    if name == "train":
        # --config FILE gives the defaults; the flags given beside it override them.
        try:
            path, _ = config_file.split_argv(argv[1:])
            if path:
                defaults = config_file.build(command("train")[0], config_file.read(path))
        except ConfigError as e:
            print(f"jaxdist: error: {e}", file=sys.stderr)
            return 2
    words = (lambda: _flags(command(name)[0])) if name else lambda: [*COMMANDS, *PASSTHROUGH]
    # The help by concern, an error in one line (help_groups).
    with INT_LISTS, grouped(), one_line_errors(words):
        if name is not None:
            kind, _ = command(name)
            args = tyro.cli(kind, default=defaults, args=argv[1:], prog=f"jaxdist {name}")
        else:  # no command, or one misspelt: the list of all of them
            args = tyro.extras.subcommand_cli_from_dict(
                {n: command(n)[0] for n in COMMANDS},
                args=argv,
                prog="jaxdist",
                description="Also: jaxdist launch|slurm|k8s [options] -- train [train options] "
                "(several processes on this host; a Slurm script; a Kubernetes JobSet).",
            )
    run = command(name or next(n for n in COMMANDS if type(args) is command(n)[0]))[1]
    try:
        with _house_style_logging():
            return run(args)
    except ConfigError as e:
        # A message that names config fields (a refused resume) names them by their flags.
        if hasattr(e, "worded"):
            e = e.worded(lambda path: config_file.flag_of(path, type(args)))
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"jaxdist: stopped: {e}", file=sys.stderr)
        _leave(1, f"stopped: {e}")  # with several processes: tell them, and go
        return 1
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop's own handler (setup, compile, restore, the other
        # commands): one line, not a traceback; 130 is the shell's code for death by SIGINT.
        print("jaxdist: interrupted (Ctrl-C); committed checkpoints are kept", file=sys.stderr)
        return 130
    except Exception as e:
        if not _distributed():
            raise
        _leave(1, f"failed: {type(e).__name__}: {e}", exit_now=False)
        if not _peer_lost(e):
            raise
        # A collective whose peer died: its stack says nothing the line does not.
        from jaxdist.cluster.launch import PEER_GONE

        first = str(e).strip().partition("\n")[0][:200]
        print(
            f"jaxdist: stopped: {PEER_GONE} ({first}); the committed checkpoints "
            "are kept, and a relaunch (or launch --max-restarts) resumes from the newest",
            file=sys.stderr,
        )
        return 1


class _HouseStyle(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"jaxdist: {record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def _house_style_logging():
    """The library's log records (a disk filling up, a damaged checkpoint) on stderr as the
    CLI's other lines say things, `jaxdist: warning: ...`, instead of the root format another
    library set up (absl's `WARNING:jaxdist.checkpoint:...`); for the command's duration."""
    logger = logging.getLogger("jaxdist")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_HouseStyle())
    handler.setLevel(logging.WARNING)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # not printed a second time by the root's handler
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _peer_lost(e: BaseException) -> bool:
    text = str(e)
    return type(e).__name__ == "JaxRuntimeError" and any(
        w in text for w in ("Connection closed by peer", "heartbeat timeout", "Connection reset")
    )


def _distributed() -> bool:
    """Whether this process joined a run of several (JAX's client exists); no backend is
    started to find out."""
    if "jax" not in sys.modules:
        return False
    import jax

    return jax.distributed.is_initialized()


def _leave(code: int, why: str, exit_now: bool = True) -> None:
    if _distributed():
        from jaxdist.cluster import join

        join.leave(code, why, exit_now)
