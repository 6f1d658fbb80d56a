"""How XLA's TPU compiler streams an FSDP weight through the matmuls that use it.

Stage 3 (move the tensors), as the compiler realizes FSDP. Where a layer weight is stored split
over the devices that split the tokens, the TPU compiler does not gather it whole before its
matmul: it runs a "windowed einsum" (collective matmul), a loop that multiplies the shard it
holds while the next one arrives from a neighbour by collective-permute, so the transfer hides
behind the matmul. The weight gradient's reduce-scatter is streamed the same way.

It has two forms, chosen here (`xla_tpu_spmd_bidirectional_windowed_einsum`):
- `one-way`: each shard goes once round the ring, n - 1 sends of 1/n of the weight per use,
  what an all-gather moves. Pays in latency: a ring of n - 1 steps.
- `two-way` (XLA's own default, and MaxText's): the ring runs both ways, for a loop half as
  long, and sends 2n + 1 shards of 1/n per use (counted in the compiled HLO of Llama layers on
  v5p-16: 17 sends of each weight's shard per use at n = 8, 2.4 times one-way's). Pays in
  bandwidth: on Llama-2-7B at fsdp=8 it sends 70.6 GB a step where one-way sends 34.6
  (experiments/README.md).

jaxdist takes one-way: the same transfers, each once. Which is faster where the ring is not
hidden behind the matmuls needs a TPU to time; `--collective-matmul two-way` gives XLA's.
Other platforms stream nothing by default; the option is TPU's alone.
"""

from jaxdist.layout import CollectiveMatmul, check_choice


def check(mode: str) -> None:
    check_choice("--collective-matmul", mode, CollectiveMatmul)


def shards_sent(mode: str, n: int) -> int:
    """Shards of 1/n of a weight each chip sends per use on a ring of n chips."""
    check(mode)
    return n - 1 if mode == "one-way" else 2 * n + 1


def compiler_options(platform: str, mode: str) -> dict[str, bool]:
    """The XLA options that choose the ring's direction, for jit on `platform`."""
    check(mode)
    if platform != "tpu":
        return {}
    return {"xla_tpu_spmd_bidirectional_windowed_einsum": mode == "two-way"}
