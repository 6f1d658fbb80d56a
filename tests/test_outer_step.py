"""The outer step's size (`--outer-lr auto`, jaxdist.parallel.rounds.outer_choice): plain
averaging at small H, in short runs and for one group, the published tuned step otherwise; a
resume takes the choice its checkpoint recorded; and the step itself (replica.send): at lr 1
without momentum the new outer weights are the groups' mean; with momentum, two rounds worked
by hand (the first theta0 - lr (1 + mu) delta: the sign torchft once got wrong; the second
carries the momentum). The run's header line: tests/test_replica.py's
resume test, which trains through the command line."""

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint import resume
from jaxdist.config import LoopConfig, RunConfig
from jaxdist.errors import ConfigError
from jaxdist.layout import SyncConfig
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.parallel import replica, rounds

AVERAGING, TUNED = (1.0, 0.0), (0.7, 0.9)


@pytest.mark.parametrize(
    "H, steps_left, replicas, expected, why",
    [
        (8, 10**6, 2, AVERAGING, "H = 8 is below 30"),  # small H, however long the run
        (29, 10**6, 8, AVERAGING, "H = 29 is below 30"),
        (30, 30 * 100, 2, TUNED, "H = 30 >= 30, 100 syncs left"),  # long enough at H >= 30
        (500, 10**6, 8, TUNED, "tuned DiLoCo step"),
        (30, 30 * 100 - 1, 2, AVERAGING, "99 syncs left, fewer than 100"),  # few syncs left
        (64, None, 2, TUNED, "H = 64 >= 30"),  # no run's length (a compile): H and M alone
        (64, 10**6, 1, AVERAGING, "one group"),
        (0, 400, 2, AVERAGING, "H = 0"),  # not a division by zero: validate then says why
    ],
)
def test_auto_averages_at_small_h_in_short_runs_and_for_one_group(
    H, steps_left, replicas, expected, why
):
    choice = rounds.outer_choice(H, steps_left, replicas)
    assert (choice.lr, choice.momentum) == expected
    assert why in choice.why


def test_the_header_line_says_which_and_why_and_given_values_stay():
    sync, line = rounds.resolved(SyncConfig(sync_every=8), 400, 2)
    assert (sync.outer_lr, sync.outer_momentum) == AVERAGING
    assert line == "outer step: lr 1, momentum 0 (auto: plain averaging, H = 8 is below 30)"
    given = SyncConfig(sync_every=8, outer_lr=0.7, outer_momentum=0.9)
    sync, line = rounds.resolved(given, 400, 2)
    assert sync == given and line == "outer step: lr 0.7, momentum 0.9 (as given)"
    # One given, the other auto: the rule fills only the auto one, and the line says which.
    sync, line = rounds.resolved(dataclasses.replace(given, outer_momentum="auto"), 400, 2)
    assert (sync.outer_lr, sync.outer_momentum) == (0.7, 0.0)
    assert "(--outer-momentum auto: plain averaging" in line


def _config(run_dir, steps: int) -> RunConfig:
    loop = LoopConfig(steps=steps, run_dir=str(run_dir))
    return dataclasses.replace(RunConfig(), loop=loop, sync=SyncConfig(sync_every=50))


def test_a_resume_takes_the_outer_step_its_checkpoint_recorded(tmp_path):
    # A run of 1000 steps at H = 50 (20 syncs) chose averaging; trained further to 10**6 steps
    # it would choose the tuned step afresh, but its checkpoint says what it has run with.
    fresh, line = resume.outer_step_for_run(_config(tmp_path, 10**6), replicas=2)
    assert (fresh.sync.outer_lr, fresh.sync.outer_momentum) == TUNED, line
    started, _ = resume.outer_step_for_run(_config(tmp_path, 1000), replicas=2)
    assert (started.sync.outer_lr, started.sync.outer_momentum) == AVERAGING
    meta = tmp_path / "checkpoints" / "700" / "meta"
    meta.mkdir(parents=True)
    record = {"config": {"sync": dataclasses.asdict(started.sync)}}
    (meta / "metadata").write_text(json.dumps(record))
    resumed, line = resume.outer_step_for_run(_config(tmp_path, 10**6), replicas=2)
    assert resumed.sync == started.sync
    assert "recorded in its checkpoint" in line
    # A value given on the resume is the user's: it wins over the record.
    given = dataclasses.replace(_config(tmp_path, 10**6), sync=SyncConfig(50, outer_lr=0.5))
    assert resume.outer_step_for_run(given, replicas=2)[0].sync.outer_lr == 0.5


@pytest.mark.parametrize(
    "sync, message",
    [
        (SyncConfig(outer_lr=0.0), "--outer-lr 0.0 must be > 0"),
        (SyncConfig(outer_momentum=1.0), r"--outer-momentum 1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_outer_values_are_refused(sync, message):
    with pytest.raises(ConfigError, match=message):
        sync.validate(2)


class _Groups(NamedTuple):
    """What replica.send reads of a train state: the groups' weights and the outer state."""

    params: Any
    outer: Any


@pytest.mark.parametrize("lr, mu", [AVERAGING, TUNED])
def test_the_outer_step_is_the_groups_mean_change_scaled_and_its_momentum_carries(lr, mu):
    # Two groups of one device; one weight, a fragment of its own. The groups' weights
    # differ, so their mean is neither's.
    mesh = build_mesh(parse_mesh("replica=2"), jax.devices()[:2])
    shape = (4, 8)
    where = {"w": replica.leaf(shape, ("embed", "mlp"), P(), dict(mesh.shape), 1)}
    owner, groups = NamedSharding(mesh, where["w"].owner), NamedSharding(mesh, P("replica"))
    sync = SyncConfig(sync_every=2, outer_lr=lr, outer_momentum=mu)
    theta0 = jnp.arange(32.0).reshape(shape) / 10
    outer = replica.OuterState(
        {"w": jax.device_put(theta0, owner)}, {"w": jax.device_put(jnp.zeros(shape), owner)}
    )
    send = jax.jit(lambda s: replica.send(s, (0,), where, sync, mesh))
    rounds_M = [jnp.stack([theta0 + 1.0, theta0 - 2.5]), jnp.stack([theta0 - 1.0, theta0 + 0.5])]
    want, m = theta0, jnp.zeros(shape)
    for theta_M in rounds_M:  # each round's groups, as they end it
        outer = send(_Groups({"w": jax.device_put(theta_M, groups)}, outer)).outer
        # torch.optim.SGD(nesterov=True, dampening=0), the outer weights less the mean as the
        # gradient: with lr 1 and no momentum the new outer weights are the groups' mean.
        delta = want - theta_M.mean(axis=0)
        m = mu * m + delta
        want = want - lr * (delta + mu * m)
        np.testing.assert_allclose(outer.params["w"], want, rtol=1e-6, atol=1e-6)
        if (lr, mu) == AVERAGING:
            np.testing.assert_allclose(outer.params["w"], theta_M.mean(axis=0), rtol=1e-6)
