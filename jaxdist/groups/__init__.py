"""Replica groups as jobs (`jaxdist launch --groups M`): each group its own `jax.distributed`
job, the outer sync outside the compiled program, through torchft in a Python 3.11 sidecar
beside each process, so a lost group costs the others one round, not a restart.

- wire: how arrays travel between a process and its sidecar, and between sidecars when a
  group heals (a JSON header and raw bytes; nothing is unpickled);
- sidecar, lighthouse: the two scripts the sidecar interpreter runs (they import no JAX);
- bridge: the JAX process's end of its sidecar;
- member: one group's process in the loop (its data, its rounds, its healing, its records);
- outer, streaming: the outer step on host arrays, and its fragments, delay and sync types by
  the compiled program's own rules and functions;
- replay: the rounds of rounds.jsonl replayed in one process (what the tests compare with);
- fleet: the launcher's side (the lighthouse and the groups, each restarted alone), and
  fleet_slurm, fleet_k8s: the same fleet as a cluster's launch files.

Why a sidecar: torchft 0.2.0 needs torch >= 2.7; on the project's Python 3.12 pip takes a CUDA
build of several GB (the outer sync runs on the CPU), while a CPU torch for Python 3.11 is what
CI already builds for the PyTorch references. The sidecar runs in that interpreter
(JAXDIST_FT_PYTHON or --ft-python: torch==2.13.0 torchft==0.2.0 numpy), and only arrays cross
between it and JAX.
"""
