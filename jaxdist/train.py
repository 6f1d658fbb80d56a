"""The training loop: plain code, top to bottom, one jitted step.

Stages of a step as they appear in `_loop`: (1) distribute work: the mesh layout, and each
batch placed by the rules (`Attempt.place`); (2) compute and (4) synchronize: the jitted
`train_step`; (3) move tensors: the collectives XLA compiled into it; (5) checkpoint and
recover: async saves to each checkpoint tier when it is due (`Tiers.save_if_due`), resume from
the newest good checkpoint, preemption and non-finite steps.

`fit` checks everything and takes the run directory; one attempt at the run is then
`open_attempt` (the record, the first state, the logs), `_loop` (the steps) and
`close_attempt` (the last save committed, summary.json), in jaxdist.attempt.
"""

import json
import pathlib
import time

import jax
from jax.sharding import Mesh
from rich.console import Console

from jaxdist.attempt import Attempt, Run, close_attempt, data_record, open_attempt
from jaxdist.checkpoint import resume
from jaxdist.checkpoint.lock import RunLock
from jaxdist.checkpoint.preemption import PreemptionSignal
from jaxdist.checkpoint.recovery import apply_nonfinite_policy
from jaxdist.checkpoint.resume import compare_with_checkpoint, finished_step, run_record
from jaxdist.cluster.join import process_rows
from jaxdist.config import RunConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.evaluation import eval_batches, small_data_warning
from jaxdist.groups import member as fleet_member
from jaxdist.layout import AxisRules, Layout
from jaxdist.metrics.outer import never_meet
from jaxdist.metrics.progress import console_for
from jaxdist.model import ModelSpec
from jaxdist.optim import make_optimizer
from jaxdist.parallel import replica
from jaxdist.step import JittedStep, Vocab, build


def prepare(
    model: ModelSpec, mesh: Mesh, rules: AxisRules, config: RunConfig
) -> tuple[JittedStep, TokenBatches]:
    """Everything that can fail on bad input, done before anything is compiled: the data
    (opened, checksummed, its vocabulary checked against the model's), then the step."""
    config.validate()
    data, seed = config.data, config.loop.seed
    batches = TokenBatches(data, model.seq_len, model.vocab_size)
    tx, lr = make_optimizer(config.optim, config.loop.steps)
    vocab = Vocab(batches.vocab_size, batches.eos_id)
    layout = Layout.on(
        mesh,
        rules,
        config.step,
        remat=getattr(model.config, "remat", ""),
        batch_size=data.batch_size,
        seq_len=model.seq_len,
        sync=config.sync,
    )
    replica.check_nonfinite(layout, mesh, config.loop.nonfinite)
    jitted = build(model.init, tx, lr, layout, mesh, seed, vocab)
    rows = process_rows(jitted.batch_sharding, (data.batch_size, model.seq_len + 1))
    group = fleet_member.settings()  # a group of `launch --groups`: its block of the fleet's
    if group is not None:
        fleet = (group.group, group.groups, group.batch_size)
        return jitted, fleet_member.batches(*fleet, data, model.seq_len, model.vocab_size, rows)
    return jitted, batches.for_rows(rows)


def fit(
    model: ModelSpec,
    mesh: Mesh,
    rules: AxisRules,
    config: RunConfig,
    console: Console | None = None,
    record: dict | None = None,
    init_state=None,
) -> dict:
    """Trains to config.loop.steps, resuming from the run directory if it holds a checkpoint;
    returns the summary (also written to summary.json). `record` joins config.json (the
    command line's config tree, under `cli`). `init_state(compiled) -> TrainState`: the first
    state of a new run (e.g. pretrained weights) instead of the model's random init."""
    # Bad input ends here, before the run directory is created or anything compiles.
    config, outer = resume.outer_step_for_run(config, dict(mesh.shape).get("replica", 1))
    jitted, batches = prepare(model, mesh, rules, config)
    console = console or console_for(stderr=True)
    if jax.process_index() != 0:
        console = Console(stderr=True, quiet=True)  # process 0 speaks for the run
    _warn_rounds(jitted, config, console)  # first: groups that would never meet
    if outer:  # which outer step, and why: one line of the run's header
        console.print(outer, markup=False, highlight=False, soft_wrap=True)
    held_out = _held_out(model, config, jitted, batches, console)
    run_dir = _run_dir(config.loop.run_dir)
    # One trainer per run directory: a second is refused here, before anything compiles.
    with RunLock(run_dir, jax.process_index()):
        done = finished_step(run_dir, config.loop.steps)
        if done is not None:
            # Another model or data stream is refused first: "train further", said of a run
            # this one cannot resume, would be advice that fails.
            now = run_record(model, mesh, rules, config, data_record(batches), record)
            compare_with_checkpoint(run_dir, now)
            return _finished(run_dir, done, console, command="cli" in (record or {}))
        run = Run(model, mesh, rules, config, jitted, batches, held_out, run_dir, console)
        # A fleet's group starts its sidecar first: it comes up while the attempt restores and
        # compiles (a restarted group rejoins sooner).
        member = fleet_member.open_member(run_dir, console, config.loop.steps)  # None: no fleet
        try:
            attempt, state = open_attempt(run, record, init_state)
        except BaseException:
            if member is not None:
                member.close()
            raise
        # From here, SIGTERM or Ctrl-C stops the run at the next step boundary, saved; a second
        # Ctrl-C ends it at once, the save in flight abandoned (end_now), also while the last
        # save commits in close_attempt.
        tiers = attempt.tiers
        stop = PreemptionSignal(tiers.checkpointer.end_now, config.loop.term_grace, tiers.newest)
        with stop as signal_flag:
            try:
                return close_attempt(attempt, _loop(attempt, state, signal_flag, member))
            finally:
                if member is not None:
                    member.close()
                # However the attempt ends (an error, a failed last save, a second Ctrl-C), what
                # the sinks have queued still reaches their files; closing twice is a no-op.
                if attempt.log:
                    attempt.log.close()


def _warn_rounds(jitted: JittedStep, config: RunConfig, console: Console) -> None:
    """One line, before anything compiles, where replica groups would never meet."""
    layout = jitted.layout
    sync = layout.sync if layout.grouped else None
    warning = never_meet(sync, layout.replicas, config.loop.steps)
    if warning:
        console.print(
            f"jaxdist: warning: {warning}",
            style="yellow",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _held_out(model, config: RunConfig, jitted, batches, console) -> TokenBatches | None:
    """The eval stream, checked against the training data; a warning when it is smaller than
    one evaluation reads."""
    explicit = bool(config.eval.eval_every) or config.eval.eval_data is not None
    held_out = eval_batches(
        config.eval, config.data, model.seq_len, model.vocab_size, jitted.batch_sharding, explicit
    )
    if held_out is None:
        return None
    if held_out.vocab_size > batches.vocab_size:
        raise ConfigError(
            f"eval data {config.eval.eval_data} has a vocabulary of {held_out.vocab_size}, the "
            f"training data {batches.vocab_size}; evaluate on data of the same tokenizer"
        )
    warning = small_data_warning(held_out, config.eval.eval_batches, "--eval-batches")
    if warning:
        console.print(
            f"jaxdist: warning: {warning}",
            style="yellow",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    return held_out


def _run_dir(given: str | None) -> pathlib.Path:
    """The run directory given, or a new one: runs/<time>, with -2, -3, ... when that name is
    taken, so that a new run never resumes another by accident."""
    if given:
        return pathlib.Path(given)
    if jax.process_count() > 1:
        raise ConfigError(
            f"a run of {jax.process_count()} processes needs --run-dir DIR: every process "
            "must name the same directory, and a relaunch must name it again to resume"
        )
    # The default is new each time; the messages that say how to resume name it exactly
    # (rerun_hint). A default that resumes (a fixed runs/latest) would make every plain
    # `jaxdist train` continue, or be refused by, whatever ran there last: a new user's second
    # experiment would quietly resume the first.
    base = time.strftime("runs/%Y%m%d-%H%M%S")
    path, n = pathlib.Path(base), 1
    while path.exists():
        n += 1
        path = pathlib.Path(f"{base}-{n}")
    return path


def _finished(run_dir: pathlib.Path, step: int, console, command: bool) -> dict:
    """A run with no step left to do: one line, nothing written, its summary returned. How to
    train further is said as the caller gives the steps: the command line's flag (`command`:
    fit's record holds the CLI's config tree), else fit's LoopConfig."""
    how = "pass --steps N" if command else "call fit with LoopConfig(steps=N)"
    console.print(
        f"run {run_dir} already finished step {step}; {how} (N > {step + 1}) to train further",
        markup=False,
        soft_wrap=True,
        highlight=False,
    )
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {"run_dir": str(run_dir)}
    return {**summary, "already_finished": step}


def _loop(a: Attempt, state, signal_flag: PreemptionSignal, member=None) -> tuple[int, str] | None:
    """Steps a.start..steps-1, then the last evaluation; returns (step, signal) when a signal
    stopped the run after that step (saved), None when it ran to its end."""
    run = a.run
    loop, jitted, console = run.config.loop, run.jitted, run.console
    eval_every = run.config.eval.eval_every or 0
    preempted = None
    pending: tuple[int, dict, dict] | None = None
    a.ledger.mark("startup")
    # The bar (a terminal only) sits under the step lines; the timer redraws it each step.
    with a.timer.bar, a.watchdog:
        s = a.start
        if member is not None:  # a fleet's group (jaxdist.groups): healed, if restarted alone
            state, s = member.start(state, s)
        while s < loop.steps:
            a.faults.before_step(s)
            a.watchdog.enter(s)
            # With replica groups, the part of their outer step due (each compiles once: the
            # timer waits out the step in flight first, so that the compile is no step's time).
            act = jitted.outer_part(s)
            a.timer.before(s, act, state)
            # Stages 2-4: forward/backward, the collectives, the update; dispatched, not awaited.
            with a.capture.step(s, state):
                state, metrics = jitted.step_fn(state, a.place(s), act)
            if member is not None:  # a round's end: the outer sync across groups, on the host
                state, s = member.after_step(s, state)
            a.capture.after(s, metrics)
            # Step s-1's scalars: s is already queued, so the device never idles for logging.
            if pending is not None:
                rec = a.timer.finish(*pending)
                if not rec["finite"]:
                    rolled = apply_nonfinite_policy(
                        loop.nonfinite, rec["step"], a.tiers.checkpointer, jitted,
                        a.tiers.shapes, console,
                    )  # fmt: skip
                    if rolled is not None:  # drop the step in flight; resume past the bad batch
                        state, s, pending = rolled, rec["step"] + 1, None
                        continue
            # Step s's record carries the mixture's proportions up to and with its rows.
            pending = (s, metrics, a.mixture.count(s))
            if run.held_out is not None and eval_every and (s + 1) % eval_every == 0:
                a.evaluate(state, s)
            # Stage 5: each tier saves when it is due; the persistent one also saves the last
            # step and the step a signal stops the run after.
            stop = signal_flag.stop_at(s)
            a.tiers.save_if_due(s, state, last=s == loop.steps - 1, stopping=stop)
            if stop:
                preempted = (s, signal_flag.received)
                break
            s += 1
        if pending is not None:
            rec = a.timer.finish(*pending)
            if not rec["finite"]:
                policy = "skip" if loop.nonfinite == "rollback" else loop.nonfinite
                apply_nonfinite_policy(
                    policy, rec["step"], a.tiers.checkpointer, jitted, a.tiers.shapes, console
                )
        last_eval = eval_every and loop.steps % eval_every == 0
        if run.held_out is not None and not preempted and not last_eval and a.start < loop.steps:
            a.evaluate(state, loop.steps - 1)
    return preempted
