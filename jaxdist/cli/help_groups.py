"""`jaxdist train --help` in panels by concern (model, data, mesh and layout, optimizer, ...)
instead of by the config a flag is stored in (`loop options` held the seed, the profiler and
the fault injection alike).

tyro (pinned) names each help panel after the nested config that holds a flag, and has no way
to put a flat flag in a panel of its choosing: only nesting it, which renames the flag (or, with
its prefix omitted, moves it in the config tree that --config files and a run's config.json
replay). So the flags and the parser stay as they are, and only the help is regrouped: while a
command line is parsed, tyro's help formatter is handed each argument under its concern's
panel (`PANELS`), in the panels' order. A flag no panel names keeps tyro's own panel (a test
holds every train flag to one). The formatter is also handed each help text as one paragraph:
tyro breaks a docstring's line wherever its source line is indented, mid-sentence."""

import contextlib
import dataclasses

# (panel, its flags in the order shown); every other train flag keeps tyro's panel, after these.
PANELS = (
    ("run", ("--config", "--steps", "--run-dir", "--seed", "--log-every", "--compile-cache")),
    (
        "model",
        (
            "--model", "--style", "--layers", "--d-model", "--heads", "--kv-heads", "--d-mlp",
            "--seq-len", "--vocab", "--init-from", "--capacity-factor", "--dropless",
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
    ("step compute", ("--compute-dtype", "--remat", "--attention", "--loss-chunk-tokens")),
    ("FP8", ("--fp8", "--fp8-history", "--fp8-filter")),
    (
        "optimizer",
        (
            "--lr", "--warmup-steps", "--schedule", "--decay-steps", "--min-lr-ratio", "--b1",
            "--b2", "--eps", "--weight-decay", "--clip", "--optimizer", "--muon-lr",
            "--muon-beta", "--muon-ns-steps",
        ),
    ),
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
    (
        "replica sync",
        (
            "--sync-every", "--outer-lr", "--outer-momentum", "--sync-fragments", "--sync-delay",
            "--sync-mix", "--outer-memory", "--sync-dtype",
        ),
    ),
    ("multi-process", ("--coordinator", "--num-processes", "--process-id", "--heartbeat-timeout")),
    ("ahead-of-time compile", ("--compile-only", "--target", "--json")),
    ("fault injection", ("--fault", "--fault-stall", "--fault-nan-steps")),
)  # fmt: skip
COMMANDS = ("jaxdist train",)  # the commands whose help is regrouped (by their prog)
_PLACE = {flag: (i, j) for i, (_, flags) in enumerate(PANELS) for j, flag in enumerate(flags)}


class _Panel:
    """A parser as tyro's formatter sees it, renamed to a panel (its `extern_prefix`, which the
    formatter titles the panel by) and with the panel's description."""

    def __init__(self, parser, name: str, description: str):
        self._parser, self.extern_prefix, self.description = parser, name, description

    def __getattr__(self, attr):
        return getattr(self._parser, attr)


def _one_paragraph(arg_ctx):
    """The argument with its help text in one paragraph (its cached lowering kept), and
    without tyro's "(default: None)" where the text says what None stands for ("default:
    --heads"): one default shown, not two."""
    arg = arg_ctx.arg
    text = arg.field.helptext
    text = text() if callable(text) else text  # tyro reads docstrings lazily
    if not isinstance(text, str):
        return arg_ctx
    says_default = arg.field.default is None and "default" in text
    if "\n" not in text and not says_default:
        return arg_ctx
    field = dataclasses.replace(arg.field, helptext=" ".join(text.split()))
    if says_default and arg.field.argconf.help_behavior_hint is None:
        argconf = dataclasses.replace(arg.field.argconf, help_behavior_hint="")
        field = dataclasses.replace(field, argconf=argconf)
    one = dataclasses.replace(arg, field=field)
    one.__dict__["lowered"] = arg.lowered  # tyro's cached_property: not worked out again
    return dataclasses.replace(arg_ctx, arg=one)


def regroup(prog: str, args: list) -> list:
    """tyro's `args` (ArgWithContext) for `prog`'s help: by concern, one paragraph each."""
    args = [_one_paragraph(a) for a in args]
    if prog not in COMMANDS:
        return args
    placed = []  # ((panel, flag's place in it), argument), unlisted flags after every panel
    for a in args:
        place = _PLACE.get(a.arg.lowered.name_or_flags[0])
        if place is None:
            placed.append(((len(PANELS), 0), a))
            continue
        name = PANELS[place[0]][0]
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
