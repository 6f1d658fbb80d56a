"""jaxdist: a distributed trainer for JAX.

The five stages of a step, and where each lives:
  1. distribute work   -> jaxdist.mesh, jaxdist.rules, jaxdist.data (batch placement)
  2. compute fwd/bwd   -> jaxdist.step (loss and gradients of a model that speaks logical axes)
  3. move tensors      -> the collectives XLA inserts from the shardings; read back by jaxdist.comm
  4. sync the update   -> jaxdist.step (optimizer update on sharded state) and jaxdist.optim
  5. checkpoint        -> jaxdist.checkpoint (later issue)
"""

__version__ = "0.1.0"
