"""Text generation on a mesh: prefill the prompt, then one token at a time from a KV cache.

A model supplies a `Decoder` (models/decode.py for the transformer): a forward over T new tokens
that reads and extends its cache, and the cache's logical axes. Rows are laid out over the batch
axes like a training batch; the prompt fills every row a device holds (rows differ only in their
random draws when sampling; row 0 is the answer), and the kv groups split over the tensor axis.

Both programs (prefill and one step) are compiled before the clock starts, so tokens/s is the
generation's own. Ids of the padded vocabulary (>= the real vocabulary size) never get
probability, greedy or sampled.
"""

import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import ConfigError
from jaxdist.layout import AxisRules, Layout
from jaxdist.rules import activation_rules, batch_sharding, batch_ways


class Decoder(NamedTuple):
    forward: Callable  # (params, tokens_BT, cache, pos) -> (logits_BTV, cache)
    init_cache: Callable[[int, int], Any]  # (rows, length) -> the cache, zeros
    cache_logical: Any  # the cache's tree, each leaf a tuple of logical axis names
    context: int  # positions the model can see


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0: greedy (argmax); else sample from softmax(logits / temperature)"""
    top_k: int | None = None
    """sample among the K most likely tokens only"""
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k {self.top_k} must be at least 1")


class Generated(NamedTuple):
    new_ids: list[int]
    seconds: float  # prefill and decode, compiled beforehand

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else 0.0


def pick(logits_BV: jax.Array, vocab_size: int, sample: SampleConfig, key) -> jax.Array:
    """The next id of each row: argmax, or a draw at the temperature among the top k; ids past
    `vocab_size` (the padding) are excluded."""
    logits_BV = logits_BV.astype(jnp.float32)
    V = logits_BV.shape[-1]
    logits_BV = jnp.where(jnp.arange(V) < vocab_size, logits_BV, -jnp.inf)
    if sample.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / sample.temperature
    if sample.top_k is not None and sample.top_k < vocab_size:
        kth_B1 = jax.lax.top_k(logits_BV, sample.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
    keys = jax.random.split(key, logits_BV.shape[0])
    return jax.vmap(jax.random.categorical)(keys, logits_BV).astype(jnp.int32)


def check_prompt(prompt_ids: list[int], context: int) -> None:
    if not prompt_ids:
        raise ConfigError("the prompt is empty; pass some text with --prompt")
    if len(prompt_ids) >= context:
        raise ConfigError(
            f"the prompt is {len(prompt_ids)} tokens, and the model's context is {context}: "
            "no room for a new token; shorten the prompt"
        )


def check_unsplit(rules: AxisRules, mesh_shape) -> None:
    """Generation adds one token a step: a sequence split (context) has nothing to split and
    would reshard the cache every step, so such a mesh is refused, before anything loads."""
    seq_axes = [a for a in rules.mesh_axes("seq", "activation") if mesh_shape.get(a, 1) > 1]
    if seq_axes:
        raise ConfigError(
            f"generation does not split the sequence over {'x'.join(seq_axes)}: use --mesh "
            "without a context axis (a checkpoint restores onto any mesh)"
        )


def generate(
    decoder: Decoder,
    params: Any,
    rules: AxisRules,
    mesh: Mesh,
    prompt_ids: list[int],
    sample: SampleConfig,
    vocab_size: int,
    stop_ids: Collection[int],
) -> Generated:
    """New ids after the prompt: up to max_new_tokens (fewer if the context ends first),
    stopping after any of `stop_ids`, a model's EOS ids (included, as Hugging Face's generate
    does)."""
    sample.validate()
    check_prompt(prompt_ids, decoder.context)
    check_unsplit(rules, mesh.shape)
    P = len(prompt_ids)
    new = min(sample.max_new_tokens, decoder.context - P)
    tokens_sharding = batch_sharding(rules, mesh)
    rows = batch_ways(tokens_sharding)
    # The chosen ids, replicated: tiny, and every process reads them (a multi-host mesh too).
    ids_sharding = NamedSharding(mesh, PartitionSpec())
    cache_sharding = jax.tree.map(
        lambda logical: NamedSharding(mesh, rules.spec(logical, "activation", "KV cache")),
        decoder.cache_logical,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    length = P + new

    layout = Layout.on(mesh, rules, batch_size=rows)

    def prefill(params, tokens_BT, cache, key):
        with activation_rules(layout, mesh):
            logits_BTV, cache = decoder.forward(params, tokens_BT, cache, 0)
        return pick(logits_BTV[:, -1], vocab_size, sample, key), cache

    def step(params, ids_B, cache, pos, key):
        with activation_rules(layout, mesh):
            logits_BTV, cache = decoder.forward(params, ids_B[:, None], cache, pos)
        return pick(logits_BTV[:, -1], vocab_size, sample, key), cache

    cache = jax.jit(lambda: decoder.init_cache(rows, length), out_shardings=cache_sharding)()
    prompt_BT = np.asarray([prompt_ids] * rows, np.int32)
    tokens = jax.make_array_from_callback(prompt_BT.shape, tokens_sharding, prompt_BT.__getitem__)
    key = jax.random.key(sample.seed)
    out = (ids_sharding, cache_sharding)
    prefill_c = jax.jit(prefill, out_shardings=out, donate_argnums=2).lower(
        params, tokens, cache, key
    )
    step_c = jax.jit(step, out_shardings=out, donate_argnums=2).lower(
        params, jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=ids_sharding), cache, 0, key
    )
    prefill_c, step_c = prefill_c.compile(), step_c.compile()

    t0 = time.perf_counter()
    ids_B, cache = prefill_c(params, tokens, cache, jax.random.fold_in(key, 0))
    new_ids = [int(jax.device_get(ids_B)[0])]
    for i in range(1, new):
        if new_ids[-1] in stop_ids:
            break
        pos = jnp.int32(P + i - 1)
        ids_B, cache = step_c(params, ids_B, cache, pos, jax.random.fold_in(key, i))
        new_ids.append(int(jax.device_get(ids_B)[0]))
    return Generated(new_ids, time.perf_counter() - t0)
