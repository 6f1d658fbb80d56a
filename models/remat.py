"""Rematerialization policies: what a layer keeps for the backward pass and what it recomputes
(`--remat none|full|dots`), as jax.checkpoint policies over the layer's primitives."""

import jax


# Gathered (FSDP) weights are never saved for the backward pass, whatever the policy: the
# backward loop gathers each layer again, since keeping all of them would undo FSDP's saving.
def _save_all_but_gathered(prim, *_, **params) -> bool:
    # A sharding constraint's output (or, inside shard_map, an all_gather's) is where a
    # gathered weight first appears, so it is recomputed (re-gathered) rather than saved; on
    # activations a constraint is a free identity.
    return prim.name not in ("sharding_constraint", "all_gather")


def _save_dots_and_attention(prim, *args, **params) -> bool:
    # Matmul outputs and the fused attention kernel's (its output and softmax statistics): the
    # backward pass recomputes only element-wise work (norms, activations, casts), as
    # torch.compile's partitioner does, and never reruns the attention kernel.
    if prim.name.startswith("dot_product_attention_fwd") or prim.name == "pallas_call":
        return True  # cuDNN's kernel, or splash attention's (the model's only Pallas call)
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


POLICIES = {
    "none": _save_all_but_gathered,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": _save_dots_and_attention,
}
