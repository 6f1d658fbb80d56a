"""Replica groups that train alone and meet every H steps: DiLoCo (arXiv:2311.08105) and its
streaming form (arXiv:2501.18512), over the `replica` mesh axis.

Stage 4, synchronize the update, moved: a step of M groups reduces its gradients inside each
group only (the inner step: `inner_step`, the plain step mapped over the groups), and every H
steps the outer step moves the shared weights by the groups' mean change (`outer_step`). The
overhead moves from communication (a gradient all-reduce over the slow axis every step) into
computation (H inner steps each group spends on its own, slightly worse, gradient) and memory
(the outer state). What each group holds and sends:

- inner weights and optimizer state: its own, `[M, ...]` split over `replica` (one group's
  per device: what data parallelism holds, 12 bytes a parameter with Adam);
- float32 / bfloat16 sync: the outer weights and Nesterov momentum split over `replica` too
  (each device 1/M of them: (12 + 8/M) / 12 of data parallelism's state). The outer step is a
  reduce of the groups' weights onto their owner (`exchange.up_many`: an all-to-all of the
  weights in the sync type, summed in float32), the update on the owner, an all-gather back
  (`exchange.down_many`): one collective each way for all the leaves a fragment syncs, as the
  slow link charges its latency per message (jaxdist.parallel.exchange: how weights travel);
- 8-bit sync: the change since the last outer step is what travels, and forming it needs the
  outer weights where each group trains: every group keeps them (4 bytes a parameter), the
  momentum stays split. Up: the change in 8 bits with a float32 scale per row; down: the
  outer update, also in 8 bits, which every group (owners too) adds to its copy, so the copies
  stay equal.

Fragments (`--sync-fragments F`): layer l belongs to fragment l % F (strided: each pipeline
stage holds a share of every fragment), the other weights to fragment 0; fragment f's round
ends after step s when s + 1 = f H/F (mod H) (jaxdist.parallel.rounds.action). With
`--sync-delay T` the exchange starts at the next step, on that step's input weights (so it
overlaps its forward and backward), and the groups take the new weights T steps after the round
ended, mixed with what they learnt since: new = mix * outer + (1 - mix) * own. Without a delay
the groups take the outer weights.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import ConfigError
from jaxdist.layout import REPLICA, Layout, SyncConfig
from jaxdist.parallel.exchange import (
    EIGHT_BIT,
    down_many,
    group_spec,
    owner_spec,
    pinned,
    up_many,
)
from jaxdist.parallel.rounds import Action, outer_values
from jaxdist.rules import activation_rules, logical_axes, variables


class OuterState(NamedTuple):
    """The outer optimizer's state: the outer weights (split over `replica`; for 8-bit sync
    every group's own copy) and the Nesterov momentum (split over `replica`)."""

    params: Any
    momentum: Any


def keeps_outer_copy(sync: SyncConfig) -> bool:
    """Whether every group keeps the outer weights (the 8-bit types send changes)."""
    return sync.sync_dtype in EIGHT_BIT


def check_nonfinite(layout: Layout, mesh: Mesh, policy: str) -> None:
    """Each group skips its own non-finite steps. Rolling back or stopping needs every process
    to see the same flags, but groups share nothing between syncs (not even their metrics), so
    a process that does not hold a device of every group cannot see the others' flags."""
    if layout.sync is None or policy == "skip":
        return
    for p in sorted({d.process_index for d in mesh.devices.flat}):
        seen = [
            r
            for r in range(layout.replicas)
            if any(d.process_index == p for d in mesh.devices[r].flat)
        ]
        if len(seen) < layout.replicas:
            raise ConfigError(
                f"--nonfinite {policy} with replica groups on different processes (process {p} "
                f"holds groups {seen} of {layout.replicas}): the groups exchange nothing between "
                "syncs to agree on a bad step; use --nonfinite skip (each group skips its own)"
            )


def recorded(record: dict, mesh_shape, run_dir) -> SyncConfig | None:
    """The sync settings of a run's record (config.json), to read its checkpoints on a mesh of
    `mesh_shape`: as many groups as it trained, each laid out anew; None without groups."""
    if not record.get("sync"):
        return None
    groups = (record.get("mesh") or {}).get(REPLICA, 1)
    if mesh_shape.get(REPLICA, 1) != groups:
        raise ConfigError(
            f"{run_dir} trained {groups} replica groups: read it on a mesh of as many, "
            f"--mesh replica={groups},... (any layout of each group)"
        )
    return SyncConfig(**record["sync"])


# --- Layouts ---------------------------------------------------------------------------------


def stacked(tree, M: int):
    """Every leaf repeated for the M groups: [M, ...]."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (M, *jnp.shape(x))), tree)


# --- The inner step ---------------------------------------------------------------------------


def inner_step(step, layout: Layout, mesh: Mesh):
    """The plain step `step(state, tokens_BT1)` run by each group on its block of the batch,
    over its own weights and optimizer state ([M, ...]); nothing crosses `replica`, the metrics
    neither: each group's own ([M]), averaged on the host (cluster.join.metric_value). A
    reduction here would make every step wait for the slowest group across the slow link."""
    M, group = layout.replicas, layout.group()

    def run(state, tokens_BT1):
        tokens_MbT1 = tokens_BT1.reshape(M, -1, tokens_BT1.shape[-1])  # group r: block r

        def one(params, opt_state, fp8, tokens_bT1):
            mine = state._replace(params=params, opt_state=opt_state, fp8=fp8)
            new, metrics = step(mine, tokens_bT1)
            return new.params, new.opt_state, new.fp8, metrics

        # Each group's FP8 state (--fp8 delayed) is its own too: its amaxes are its batches'.
        with activation_rules(group, mesh):
            params, opt_state, fp8, metrics_M = jax.vmap(one, spmd_axis_name=REPLICA)(
                state.params, state.opt_state, state.fp8, tokens_MbT1
            )
        new = state._replace(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
        return new, metrics_M

    return run


def metrics_sharding(mesh: Mesh) -> NamedSharding:
    """The groups' metrics ([M]) stay with their group: the step's output crosses nothing."""
    return NamedSharding(mesh, PartitionSpec(REPLICA))


# --- Fragments ---------------------------------------------------------------------------------


def take(x, dim: int | None, F: int, f: int, lead: int):
    """Fragment f of leaf x: its layers l % F == f (dim `dim` after `lead` leading dims)."""
    if F == 1:
        return x
    if dim is None:
        return x if f == 0 else None
    d = dim + lead
    split = x.reshape(*x.shape[:d], x.shape[d] // F, F, *x.shape[d + 1 :])
    return jnp.take(split, f, axis=d + 1)


def put(x, new, dim: int | None, F: int, f: int, lead: int):
    if F == 1 or dim is None:
        return new if new is not None else x
    d = dim + lead
    split = x.reshape(*x.shape[:d], x.shape[d] // F, F, *x.shape[d + 1 :])
    index = (slice(None),) * (d + 1) + (f,)
    return split.at[index].set(new).reshape(x.shape)


def _fetched(x, spec: PartitionSpec, sync: SyncConfig, mesh: Mesh):
    """An outer-state leaf in device memory (kept in host memory with --outer-memory host: it
    crosses to the device only for the outer step, and back)."""
    if sync.outer_memory != "host":
        return x
    return jax.device_put(x, NamedSharding(mesh, spec, memory_kind="device"))


def nesterov(delta, momentum, lr: float, mu: float):
    """torch.optim.SGD(nesterov=True, dampening=0) on `delta` as the gradient: the step to
    subtract and the new momentum. Pure arithmetic: inside the compiled step here, and on host
    arrays for groups that are jobs of their own (jaxdist.groups.outer)."""
    momentum = mu * momentum + delta
    return lr * (delta + mu * momentum), momentum


class Leaf(NamedTuple):
    """Where one parameter lives: its layers dim, its spec in a group, its owners' spec."""

    dim: int | None
    spec: PartitionSpec
    owner: PartitionSpec


def leaf(shape, logical, spec: PartitionSpec, mesh_shape, fragments: int) -> Leaf:
    """Where a parameter of `shape` and logical axes `logical`, laid out by `spec` in a group,
    lives (the step's and the planner's one rule). `fragments` divides the layers: both call
    SyncConfig.validate with them first."""
    dim = logical.index("layers") if "layers" in logical else None
    spec = PartitionSpec(*spec, *[None] * (len(shape) - len(spec)))
    avoid = dim if fragments > 1 else None
    return Leaf(dim, spec, owner_spec(spec, tuple(shape), mesh_shape, avoid))


def layers(abstract_params) -> int | None:
    """The model's layers, which fragments cut (the size of its `layers` dims); None: none."""
    for var in variables(abstract_params):
        if "layers" in logical_axes(var):
            return var.shape[logical_axes(var).index("layers")]
    return None


def leaves(abstract_params, param_sharding, mesh: Mesh, fragments: int) -> Any:
    """Per parameter (in the params' tree, where each array is), its Leaf."""
    flat, treedef = jax.tree.flatten(abstract_params)
    specs = [s.spec for s in jax.tree.leaves(param_sharding)]
    found = [
        leaf(x.shape, logical_axes(var), spec, dict(mesh.shape), fragments)
        for var, x, spec in zip(variables(abstract_params), flat, specs, strict=True)
    ]
    return treedef.unflatten(found)


def _kept(leaf: Leaf, sync: SyncConfig) -> PartitionSpec:
    """Where the outer weights of a parameter are kept: on its owners, or every group's own."""
    return leaf.spec if keeps_outer_copy(sync) else leaf.owner


def sharding(state_sharding, where, sync: SyncConfig, mesh: Mesh):
    """The train state's shardings with groups: each group's weights, optimizer state and FP8
    state stacked over `replica` (its scalars, such as Adam's count, one per group), the outer
    state on its owners (the outer weights in every group where the 8-bit types need them)."""

    def named(spec, memory: str = "device"):
        return NamedSharding(mesh, spec, memory_kind=memory)

    def on_leaves(fn, memory: str = "device"):
        return jax.tree.map(lambda leaf: named(fn(leaf), memory), where, is_leaf=_is_leaf)

    opt = jax.tree.map(lambda s: named(group_spec(s.spec)), state_sharding.opt_state)
    fp8 = jax.tree.map(lambda s: named(group_spec(s.spec)), state_sharding.fp8)
    kept = "pinned_host" if sync.outer_memory == "host" else "device"
    outer = OuterState(
        on_leaves(lambda leaf: _kept(leaf, sync), kept), on_leaves(lambda leaf: leaf.owner, kept)
    )
    params = on_leaves(lambda leaf: group_spec(leaf.spec))
    return state_sharding._replace(params=params, opt_state=opt, outer=outer, fp8=fp8)


def first_state(params, opt_state, M: int):
    """The groups' first state: each starts from the same weights and optimizer state; the
    outer weights are those weights, the momentum zero."""
    outer = OuterState(params, jax.tree.map(jnp.zeros_like, params))
    return stacked(params, M), stacked(opt_state, M), outer


def _fragment(f: int, where: list) -> list[int]:
    """The places (in jax.tree order) of the parameters fragment f holds a part of."""
    return [i for i, leaf in enumerate(where) if leaf.dim is not None or f == 0]


def _send_fragment(f: int, sync: SyncConfig, mesh: Mesh, where: list, theta, outer, mom):
    """Fragment f's outer step (lists in jax.tree order): (outer weights, momentum). Its
    leaves travel together (exchange.up_many, down_many: one collective per type and way)."""
    F, dtype, mine = sync.sync_fragments, sync.sync_dtype, _fragment(f, where)
    lr, mu = outer_values(sync, mesh.shape[REPLICA])
    step_of = functools.partial(nesterov, lr=lr, mu=mu)
    specs, owners = [where[i].spec for i in mine], [where[i].owner for i in mine]
    for i in mine:
        outer[i] = _fetched(outer[i], _kept(where[i], sync), sync, mesh)
        mom[i] = _fetched(mom[i], where[i].owner, sync, mesh)
    own = [take(outer[i], where[i].dim, F, f, 0) for i in mine]
    m = [take(mom[i], where[i].dim, F, f, 0) for i in mine]
    theta_M = [take(theta[i], where[i].dim, F, f, 1) for i in mine]
    if keeps_outer_copy(sync):  # each group's change from its copy of the outer weights, in 8 bits
        changes = [o[None] - t for o, t in zip(own, theta_M, strict=True)]
        means = up_many(changes, specs, owners, dtype, mesh)
        steps, m = zip(*map(step_of, means, m), strict=True)
        steps = down_many(steps, specs, owners, dtype, mesh)  # every copy takes the same update
    else:  # the groups' weights, meeting on their owners
        means = up_many(theta_M, specs, owners, dtype, mesh)
        deltas = [pinned(o, mesh, ow) - x for o, ow, x in zip(own, owners, means, strict=True)]
        steps, m = zip(*map(step_of, deltas, m), strict=True)
    for k, i in enumerate(mine):
        outer[i] = put(outer[i], own[k] - steps[k], where[i].dim, F, f, 0)
        mom[i] = put(mom[i], m[k], where[i].dim, F, f, 0)
    return outer, mom


def send(state, fragments, where, sync: SyncConfig, mesh: Mesh):
    """The outer step of `fragments` from the groups' weights in `state`: the exchange and the
    outer update (with 8-bit sync, also the groups' copies of the outer weights)."""
    places, treedef = jax.tree.flatten(where, is_leaf=_is_leaf)
    theta = treedef.flatten_up_to(state.params)
    outer, mom = (treedef.flatten_up_to(x) for x in state.outer)
    for f in fragments:
        outer, mom = _send_fragment(f, sync, mesh, places, theta, outer, mom)
    return state._replace(outer=OuterState(treedef.unflatten(outer), treedef.unflatten(mom)))


def _taken(theta_M, own, leaf: Leaf, F: int, f: int, mix: float, mesh: Mesh):
    """Fragment f of one parameter: the groups take `own` (the outer weights, in every group's
    layout), mixed with their own by `mix`."""
    new_M = jnp.broadcast_to(own[None], (theta_M.shape[0], *own.shape))
    new_M = pinned(new_M, mesh, group_spec(leaf.spec))  # each group's copy is its own
    if mix < 1:
        new_M = mix * new_M + (1 - mix) * take(theta_M, leaf.dim, F, f, 1)
    return put(theta_M, new_M.astype(theta_M.dtype), leaf.dim, F, f, 1)


def apply(state, fragments, where, sync: SyncConfig, mesh: Mesh, mix: float):
    """The groups take the outer weights of `fragments`, mixed with their own by `mix`."""
    places, treedef = jax.tree.flatten(where, is_leaf=_is_leaf)
    theta, outer = (treedef.flatten_up_to(x) for x in (state.params, state.outer.params))
    F = sync.sync_fragments
    for f in fragments:
        mine = _fragment(f, places)
        kept = [_kept(places[i], sync) for i in mine]
        own = [
            take(_fetched(outer[i], k, sync, mesh), places[i].dim, F, f, 0)
            for i, k in zip(mine, kept, strict=True)
        ]
        if not keeps_outer_copy(sync):  # the owners' pieces, gathered in the sync type (together)
            specs = [places[i].spec for i in mine]
            own = down_many(own, specs, kept, sync.sync_dtype, mesh)
        for i, o in zip(mine, own, strict=True):
            theta[i] = _taken(theta[i], o, places[i], F, f, mix, mesh)
    return state._replace(params=treedef.unflatten(theta))


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def outer_step(state, act: Action, where, sync: SyncConfig, mesh: Mesh, inner):
    """One step: the inner step, with the outer step's parts that `act` asks for around it."""
    if act.send and not act.after:
        state = send(state, act.send, where, sync, mesh)  # on the step's input: overlaps it
    state, metrics = inner(state)
    if act.send and act.after:
        state = send(state, act.send, where, sync, mesh)
    if act.apply:
        mix = 1.0 if act.after else sync.sync_mix
        state = apply(state, act.apply, where, sync, mesh, mix)
    return state, metrics
