"""jaxdist: a distributed trainer for JAX.

The five stages of a step, and where each lives:
  1. distribute work   -> mesh (layouts), rules (logical axes onto mesh axes), data (batches);
                          planning/ chooses a layout before the fleet is rented
  2. compute fwd/bwd   -> step (loss and gradients of a model that speaks logical axes);
                          kernels/ (attention, fused loss, packed documents); parallel/ where
                          per-device control is the point (pipeline, experts)
  3. move tensors      -> the collectives XLA inserts from the shardings; compiled/comm_report and
                          profiling/ read them back out of the program and the trace
  4. sync the update   -> step (the optimizer update on sharded state), optim; replica groups
                          that meet every H steps: parallel/replica, parallel/rounds
  5. checkpoint        -> checkpoint/ (tiers: the Orbax store and the node-local one, each
                          saving when its Young-Daly interval is due; resume, recovery)
Around them: metrics/ (what a run records), profiling/, cluster/, hf/, inference/, cli/.

The loop that runs them is jaxdist.fit (jaxdist.train.fit). From a script (see
experiments/own_model.py):

    import jaxdist
    mesh = jaxdist.make_mesh("data=2,fsdp=2,tensor=2")
    summary = jaxdist.fit(model_spec, mesh, rules, jaxdist.RunConfig(...))

The names below load on first use, so `import jaxdist` stays cheap.
"""

import importlib
import sys

__version__ = "0.1.0"

_API = {
    # devices and layouts
    "setup_devices": "jaxdist.mesh",
    "make_mesh": "jaxdist.mesh",
    "parse_mesh": "jaxdist.mesh",
    "AxisRules": "jaxdist.layout",
    "LOGICAL_AXES": "jaxdist.model",
    "Documents": "jaxdist.kernels.documents",
    # configs, one per component
    "ModelSpec": "jaxdist.model",
    "OptimConfig": "jaxdist.config",
    "DataConfig": "jaxdist.config",
    "StepConfig": "jaxdist.layout",
    "LoopConfig": "jaxdist.config",
    "EvalConfig": "jaxdist.config",
    "RunConfig": "jaxdist.config",
    "Layout": "jaxdist.layout",
    "SyncConfig": "jaxdist.layout",
    "CheckpointConfig": "jaxdist.checkpoint.interval",
    # training and its pieces
    "fit": "jaxdist.train",  # the loop
    "prepare": "jaxdist.train",
    "evaluate": "jaxdist.evaluation",
    "build": "jaxdist.step",
    "make_optimizer": "jaxdist.optim",
    "TokenBatches": "jaxdist.data",
    "restore": "jaxdist.checkpoint.store",
    # looking at a step
    "profile": "jaxdist.profiling.report",
    "compile_only": "jaxdist.compiled.aot",
    "plan": "jaxdist.planning.planner",
    "PlanConfig": "jaxdist.planning.inputs",
    "PlanModel": "jaxdist.planning.inputs",
    "ConfigError": "jaxdist.errors",
}
__all__ = sorted(_API)


def lazy_api(package: str, api: dict[str, str]):
    """A module `__getattr__` importing each name of `api` (name -> module) on first use, so
    that importing a package costs nothing until a name is used."""

    def load(name: str):
        if name not in api:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(api[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return load


__getattr__ = lazy_api(__name__, _API)
