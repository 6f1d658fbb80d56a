"""`jaxdist train --help` (and plan's, comm's, bench's) in panels by concern (model, data,
mesh and layout, optimizer, ...) instead of by the config a flag is stored in (`loop options`
held the seed, the profiler and the fault injection alike).

tyro (pinned) names each help panel after the nested config that holds a flag, and has no way
to put a flat flag in a panel of its choosing: only nesting it, which renames the flag (or, with
its prefix omitted, moves it in the config tree that --config files and a run's config.json
replay). So the flags and the parser stay as they are, and only the help is regrouped: while a
command line is parsed, tyro's help formatter is handed each argument under its concern's
panel (`COMMANDS`: each command's panels), in the panels' order. A flag no panel names keeps
tyro's own panel (a test holds every flag of these commands to one). The formatter is also
handed each help text as one paragraph: tyro breaks a docstring's line wherever its source line
is indented, mid-sentence.

`one_line_errors`: tyro's parse errors (a 6-9-line box) as one line in jaxdist's own words,
naming the command's help."""

import contextlib
import dataclasses
import difflib
import re
import sys
from collections.abc import Callable, Iterable

# Flags several commands share, under the same concern in each.
_MODEL = (
    "--model", "--style", "--layers", "--d-model", "--heads", "--kv-heads", "--d-mlp", "--seq-len",
    "--vocab", "--capacity-factor", "--moe-buffer-factor", "--moe-gemm", "--mtp-depth",
    "--mtp-loss-weight",
)  # fmt: skip
_LAYOUT = (
    "--microbatches", "--pipeline-schedule", "--virtual-stages", "--context-strategy",
    "--collective-matmul", "--document-mask",
)  # fmt: skip
_COMPUTE = ("--compute-dtype", "--remat", "--attention", "--loss-chunk-tokens")
_FP8 = ("--fp8", "--fp8-history", "--fp8-filter")
_SYNC = (
    "--sync-every", "--outer-lr", "--outer-momentum", "--sync-fragments", "--sync-delay",
    "--sync-mix", "--outer-memory", "--sync-dtype",
)  # fmt: skip
_OPTIMIZER = (
    "--lr", "--warmup-steps", "--schedule", "--decay-steps", "--min-lr-ratio", "--b1", "--b2",
    "--eps", "--weight-decay", "--clip", "--optimizer", "--muon-lr", "--muon-beta",
    "--muon-ns-steps",
)  # fmt: skip
# (panel, its flags in the order shown); every other train flag keeps tyro's panel, after these.
PANELS = (
    ("run", ("--config", "--steps", "--run-dir", "--seed", "--log-every", "--compile-cache")),
    (
        "model",
        (
            "--model", "--style", "--layers", "--d-model", "--heads", "--kv-heads", "--d-mlp",
            "--seq-len", "--vocab", "--init-from", "--capacity-factor", "--moe-buffer-factor",
            "--moe-gemm", "--mtp-depth", "--mtp-loss-weight",
        ),
    ),
    ("data", ("--data", "--batch-size", "--document-mask")),
    (
        "devices, mesh and layout",
        (
            "--devices", "--mesh", "--microbatches", "--pipeline-schedule", "--virtual-stages",
            "--context-strategy", "--collective-matmul",
        ),
    ),
    ("step compute", _COMPUTE),
    ("FP8", _FP8),
    ("optimizer", _OPTIMIZER),
    (
        "checkpointing and recovery",
        (
            "--checkpoint-every", "--checkpoint-keep", "--mtbf-hours-per-device",
            "--checkpoint-cap-minutes", "--local-checkpoint-dir", "--local-checkpoint-every",
            "--local-loss-share", "--allow-fresh-start", "--nonfinite", "--term-grace",
        ),
    ),
    ("evaluation", ("--eval-every", "--eval-batches", "--eval-data")),
    (
        "profiling and monitoring",
        (
            "--profile", "--watch-comm", "--watch-every", "--hardware", "--peak-tflops",
            "--slow-step-factor", "--hang-timeout", "--wandb", "--wandb-entity",
        ),
    ),
    ("replica sync", _SYNC),
    ("multi-process", ("--coordinator", "--num-processes", "--process-id", "--heartbeat-timeout")),
    ("ahead-of-time compile", ("--compile-only", "--target", "--json")),
    ("fault injection", ("--fault", "--fault-stall", "--fault-nan-steps")),
)  # fmt: skip
# The other commands that take train's model and step flags, by the same concerns where they
# share them, each with its own first (what plan plans for, what bench times).
PLAN_PANELS = (
    ("model", _MODEL),
    ("devices and batch", ("--hardware", "--slices", "--devices", "--batch-size")),
    ("layouts searched", ("--mesh", "--axes", *_LAYOUT)),
    ("step compute", (*_COMPUTE, "--compute-efficiency")),
    ("FP8", _FP8),
    ("replica groups", ("--replicas", "--link-gbps", *_SYNC)),
    ("report", ("--top", "--wide", "--verify", "--json", "--compile-cache")),
    ("fault injection", ("--fault-nan-steps",)),
)
# comm and bench compile the step train runs: its model, layout, compute and FP8 first.
_STEP = (
    ("model", _MODEL),
    ("devices, mesh and layout", ("--devices", "--mesh", "--batch-size", *_LAYOUT)),
    ("step compute", _COMPUTE),
    ("FP8", _FP8),
)
COMM_PANELS = (
    *_STEP,
    ("optimizer", _OPTIMIZER),
    ("replica sync", _SYNC),
    ("report", ("--json", "--seed", "--compile-cache")),
    ("fault injection", ("--fault-nan-steps",)),
)
BENCH_PANELS = (
    *_STEP,
    ("replica sync", _SYNC),
    ("timing", ("--steps", "--warmup", "--peak-tflops", "--seed", "--compile-cache")),
    ("fault injection", ("--fault-nan-steps",)),
)  # fmt: skip
# The commands whose help is regrouped (by their prog), and each one's panels.
COMMANDS = {
    "jaxdist train": PANELS,
    "jaxdist plan": PLAN_PANELS,
    "jaxdist comm": COMM_PANELS,
    "jaxdist bench": BENCH_PANELS,
}
_PLACES = {
    prog: {flag: (i, j) for i, (_, flags) in enumerate(panels) for j, flag in enumerate(flags)}
    for prog, panels in COMMANDS.items()
}


class _Panel:
    """A parser as tyro's formatter sees it, renamed to a panel (its `extern_prefix`, which the
    formatter titles the panel by) and with the panel's description."""

    def __init__(self, parser, name: str, description: str):
        self._parser, self.extern_prefix, self.description = parser, name, description

    def __getattr__(self, attr):
        return getattr(self._parser, attr)


# What a flag left unset (None) means, where its text cannot say it (a config outside cli/);
# every other unset flag reads "(default: off)": the feature it turns on is off.
_UNSET = {
    "--config": "none, the flags alone",
    "--coordinator": "detected (Slurm, MPI, Kubernetes), else one process",
    "--num-processes": "detected, else 1",
    "--process-id": "detected, else 0",
}


def _one_paragraph(arg_ctx):
    """The argument with its help text in one paragraph (its cached lowering kept), its
    default read as a value: "(default: off)", not tyro's "(default: None)" and `{None}|INT`
    (none where the text says what None stands for, "default: --heads": one default shown,
    not two); True and False as on and off."""
    arg = arg_ctx.arg
    text = arg.field.helptext
    text = text() if callable(text) else text  # tyro reads docstrings lazily
    if not isinstance(text, str):
        return arg_ctx
    field = dataclasses.replace(arg.field, helptext=" ".join(text.split()))
    hint = _default_hint(arg, text)
    if hint is not None and arg.field.argconf.help_behavior_hint is None:
        argconf = dataclasses.replace(arg.field.argconf, help_behavior_hint=hint)
        field = dataclasses.replace(field, argconf=argconf)
    one = dataclasses.replace(arg, field=field)
    lowered = arg.lowered
    metavar = re.sub(r"^{None}\|", "", re.sub(r"^{None,", "{", str(lowered.metavar)))
    if lowered.metavar is not None and metavar != lowered.metavar:
        lowered = dataclasses.replace(lowered, metavar=metavar)
    one.__dict__["lowered"] = lowered  # tyro's cached_property: not worked out again
    return dataclasses.replace(arg_ctx, arg=one)


def _default_hint(arg, text: str) -> str | None:
    """The help's "(default: ...)" for an unset, boolean or empty default; None: tyro's own."""
    default = arg.field.default
    flag = arg.lowered.name_or_flags[0] if arg.lowered.name_or_flags else ""
    if default is None:
        return "" if "default" in text else f"(default: {_UNSET.get(flag, 'off')})"
    if isinstance(default, bool):
        return f"(default: {'on' if default else 'off'})"
    if default == () and arg.lowered.action != "append":  # a list flag given no values
        return "(default: none)"
    return None


def regroup(prog: str, args: list) -> list:
    """tyro's `args` (ArgWithContext) for `prog`'s help: by concern, one paragraph each."""
    args = [_one_paragraph(a) for a in args]
    if prog not in COMMANDS:
        return args
    panels, places = COMMANDS[prog], _PLACES[prog]
    placed = []  # ((panel, flag's place in it), argument), unlisted flags after every panel
    for a in args:
        place = places.get(a.arg.lowered.name_or_flags[0])
        if place is None:
            placed.append(((len(panels), 0), a))
            continue
        name = panels[place[0]][0]
        # The replica groups' config says what the panel is for (its docstring); the rest
        # need no more than their names.
        said = a.source_parser.description if name == "replica sync" else ""
        placed.append(
            (place, dataclasses.replace(a, source_parser=_Panel(a.source_parser, name, said)))
        )
    return [a for _, a in sorted(placed, key=lambda pa: pa[0])]


@contextlib.contextmanager
def grouped():
    """While parsing: tyro's help formatter takes the arguments `regroup`ed. Without the
    formatter where it was (another tyro), tyro's own help, unchanged."""
    try:
        from tyro._backends import _tyro_help_formatting as formatting
    except ImportError:
        yield
        return
    original = getattr(formatting, "format_help", None)
    if original is None:
        yield
        return

    def format_help(prog, parser_spec, args, subparser_frontier, verbose=False):
        return original(
            prog=prog,
            parser_spec=parser_spec,
            args=regroup(prog, args),
            subparser_frontier=subparser_frontier,
            verbose=verbose,
        )

    formatting.format_help = format_help
    try:
        yield
    finally:
        formatting.format_help = original


@contextlib.contextmanager
def one_line_errors(words: Callable[[], Iterable[str]]):
    """While parsing: a flag's bad value, an unknown flag or a missing argument ends in one line,
    `jaxdist: error: CAUSE; see jaxdist CMD --help`, and exit code 2, as tyro's box did.
    `words`: what an unknown word may be a misspelling of (the command's flags, or the
    commands). Without tyro's parse-error hook (another tyro), tyro's own boxes."""
    try:
        from tyro import _errors
    except ImportError:
        yield
        return

    def hook(event) -> None:
        cause = _cause(event, _errors, words)
        if cause is None:  # an error this tyro added since: its own box
            return
        print(f"jaxdist: error: {cause}; see {event.prog} --help", file=sys.stderr, flush=True)
        raise SystemExit(2)

    with _errors.on_parse_error(hook):
        yield


def _cause(event, errors, words: Callable[[], Iterable[str]]) -> str | None:
    """What is wrong, for tyro's parse error `event` (tyro._errors' event types)."""
    if isinstance(event, errors.InvalidChoice):
        # In the order the help lists them, `{auto,preset,none}` (the event's come from a set).
        metavar = str(event.argument.lowered.metavar)
        listed = metavar[1:-1].split(",") if re.fullmatch(r"{[^}]*}", metavar) else event.choices
        choices = ", ".join(str(c) for c in listed if str(c) != "None")
        return f"{_name(event.argument)} {event.value!r} is not one of {choices}"
    if isinstance(event, errors.InstantiationFailure):
        if event.argument is None:
            return event.message
        return _bad_value(_name(event.argument), event.argument.lowered.metavar, event.message)
    if isinstance(event, errors.BadValue) and event.reason == "too_few_values":
        return f"{_name(event.argument)} needs a value"
    if isinstance(event, errors.MissingArgs):
        needed = " ".join(_name(a.arg) for a in event.missing_arguments)
        return f"{event.prog} needs {needed}"
    if isinstance(event, errors.MissingSubcommand):
        return f"name a command: {', '.join(event.subcommand_spec.parser_from_name)}"
    if isinstance(event, errors.UnrecognizedArgs):
        flags = [t for t in event.tokens if t.startswith("-")]
        if not flags:
            kind = "command" if event.prog == "jaxdist" else "argument"
            return _unknown(f"{kind} {' '.join(event.tokens)}", event.tokens[0], words)
        return _unknown(f"option {' '.join(flags)}", flags[0].partition("=")[0], words)
    return None


def _name(arg) -> str:
    """A flag's first name, or a positional argument's (RUN_DIR: its metavar, or its field's
    name where the metavar is only its type)."""
    if arg.is_positional():
        metavar = str(arg.lowered.metavar)
        return arg.field.intern_name.upper() if metavar in ("STR", "INT", "FLOAT") else metavar
    return arg.lowered.name_or_flags[0]


def _bad_value(flag: str, metavar, message: str) -> str:
    """`--steps 'x' is not an integer`, from Python's "invalid literal for int() ...: 'x'"."""
    given = re.search(r": ('.*')$", message)
    kinds = {"INT": "an integer", "FLOAT": "a number"}
    kind = next((v for k, v in kinds.items() if re.search(rf"\b{k}\b", str(metavar))), None)
    if given and kind:
        return f"{flag} {given.group(1)} is not {kind}"
    return f"{flag}: {message}"


def _unknown(what: str, word: str, words: Callable[[], Iterable[str]]) -> str:
    close = difflib.get_close_matches(word, list(words()), n=1)
    return f"unknown {what}" + (f" (did you mean {close[0]}?)" if close else "")
