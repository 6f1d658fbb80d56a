"""Parallelism that needs per-device control (shard_map): pipeline stages and their schedules,
experts reached by all-to-all, attention across a sequence split over `context`. Data, FSDP
and tensor parallelism need none: they are the rule table's shardings, realized by jit; the
one compiler option jaxdist sets for them, the direction of the TPU's weight rings, is
collective_matmul's."""
