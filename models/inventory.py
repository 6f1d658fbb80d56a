"""What the planner and `jaxdist comm` need to know of the transformer, beyond its weights.

Where its matmuls leave partial sums when a split dimension is sharded (the activation traffic
of tensor and expert parallelism), and what one (micro)batch keeps alive for the backward pass
(the activation memory). Both are declared in logical axes; jaxdist's rules say how each splits
over a layout. `plan_model` hands the planner the whole description.

Latent attention (models/mla.py) is approximate here: its weights are exact (the planner reads
them, the down-projections as matmuls of `embed` against their rank), but its activations are
priced as q, k and the heads' up-projected keys and values (the latents, R + C + P wide a token,
left out), its context-parallel exchange as keys and values of the mean q.k and value width,
and its tensor-parallel input gradients as sums of the up-projections' inputs.
"""

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from jaxdist.layout import Layout, ways
from jaxdist.parallel import dropless
from jaxdist.parallel.context import carrier
from jaxdist.parallel.experts import dispatch_rows
from jaxdist.planning.inputs import Activation, Inventory, PartialSum, PlanModel
from models.mla import MLA_LOGICAL
from models.remat import RECOMPUTE
from models.transformer import LOGICAL, Transformer, TransformerConfig
from models.transformer_config import stacks


def plan_model(config: TransformerConfig) -> PlanModel:
    """The planner's view of a model config."""
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))
    return PlanModel(
        name=config.name,
        abstract_params=abstract,
        num_layers=config.num_layers,
        seq_len=config.seq_len,
        d_model=config.d_model,
        flops_per_token=config.flops_per_token(),
        compute_bytes=jnp.dtype(config.compute_dtype).itemsize,
        num_experts=config.num_experts,
        inventory=lambda rows: activations(config, rows),
        partial_sums=lambda layout, platform: partial_sums(config, layout, platform),
        # What the policy reruns, priced as compute: its share of the layers' matmuls, and
        # attention's forward where full remat reruns the kernel or XLA's unfused attention
        # (not a saved kernel output) is recomputed.
        recompute_matmul=RECOMPUTE[config.remat](config),
        recompute_attention=config.remat == "full"
        or (config.attention == "xla" and config.remat != "none"),
        remat=config.remat,
        reruns=_reruns(config.remat),
        top_k=config.top_k if config.num_experts else 1,
        expert_slots=_expert_slots(config),
    )


def _expert_slots(c: TransformerConfig) -> float:
    """Rows each active expert multiplies per routed token (jaxdist.parallel.experts): in
    capacity mode every slot of its buffer runs, filled or not; dropless, the grouped GEMMs run
    the routed rows (their receive bound with expert parallelism is an upper limit)."""
    if not c.num_experts or c.capacity_factor is None:
        return 1.0
    return c.capacity_factor


def _reruns(policy: str) -> frozenset[tuple]:
    """The layer weights whose forward matmul the backward reruns under `policy`: full remat
    reruns the layer up to its last matmul (the down projection, whose output nothing after
    it in the layer needs); dots_except_mlp reruns the MLP's gate and up projections."""
    mlp_in = {LOGICAL["w_up_LDF"], LOGICAL["w_gate_LDF"]}
    # Latent attention's weights too: no other weight carries their logical axes.
    attention = {LOGICAL["wqkv_LDGQH"], LOGICAL["wo_LNHD"], *MLA_LOGICAL.values()}
    return frozenset({"full": attention | mlp_in, "dots_except_mlp": mlp_in}.get(policy, ()))


def partial_sums(c: TransformerConfig, layout: Layout, platform: str = "cpu") -> list[PartialSum]:
    """Where this model's matmuls leave partial sums when their split dims are sharded,
    and (MoE) the buffers its experts exchange, on `layout`. Pipelined (stages > 1, `virtual`
    chunks each): a device runs its L / stages layers, replays their forward in the backward
    tick, and runs the embedding and head (masked) in each of its forward ticks
    (jaxdist.parallel.pipeline). `platform`: GPU's and TPU's compilers sum two partial sums
    bound for the same all-reduce before reducing (XLA's all-reduce reassociation; the CPU
    pipeline does not)."""
    microbatches = layout.microbatches
    stages, virtual = layout.stages, layout.virtual_stages
    context = (carrier(layout.step.context_strategy, platform, stages > 1), layout.seq_ways)
    B, T, D = layout.micro_rows, c.seq_len, c.d_model
    nbytes = jnp.dtype(c.compute_dtype).itemsize
    x, btd = ("batch", "seq", "embed"), (B, T, D)
    sums = []
    for _, stack in stacks(c):  # each layer stack's layers (dense first layers, then MoE)
        per_layer = _layer_sums(stack, layout, context, platform)
        L = stack.num_layers // stages
        sums += [dataclasses.replace(p, count=p.count * L) for p in per_layer]
    if stages > 1 and not c.num_experts:
        # The backward tick's replay needs each layer's output only as the next layer's input:
        # the last layer's MLP output, and so its all-reduce, is dead code, once per chunk.
        sums.append(PartialSum(-virtual, x, btd, "mlp", nbytes))
    sums += [
        PartialSum(virtual, x, btd, "vocab", nbytes),  # embedding lookup in a vocab-split table
        PartialSum(virtual, x, btd, "vocab", nbytes),  # backward: input grad of the output head
        # Cross-entropy over split logits: the max, the sum of exponentials, the target.
        PartialSum(3 * virtual, ("batch", "seq"), (B, T), "vocab", 4),
    ]
    return [dataclasses.replace(p, count=p.count * microbatches) for p in sums]


def _layer_sums(
    c: TransformerConfig, layout: Layout, context: tuple[str, int], platform: str
) -> list[PartialSum]:
    """One layer's partial sums (partial_sums' terms, once per layer)."""
    B, T, D, stages = layout.micro_rows, c.seq_len, c.d_model, layout.stages
    nbytes = jnp.dtype(c.compute_dtype).itemsize
    x, btd = ("batch", "seq", "embed"), (B, T, D)
    # Full remat, or a pipeline's backward tick, replays the forward. Full remat's replay stops
    # before the MLP's down projection: the backward needs no layer's output, so its sum is
    # dead code there (a pipeline's replay needs each layer's output as the next's input).
    fwd = 2 if c.remat == "full" or stages > 1 else 1
    down = 2 if stages > 1 else 1
    per_layer = [
        PartialSum(fwd, x, btd, "heads", nbytes),  # attention output projection
        PartialSum(1, x, btd, "kv_heads", nbytes),  # backward: input grad of fused QKV
    ]
    if c.mla:  # backward: input grads of the heads' up-projections (q's from D or R, kv's from C)
        per_layer[1:] = [
            PartialSum(1, x, (B, T, c.q_lora_rank or D), "heads", nbytes),
            PartialSum(1, x, (B, T, c.kv_lora_rank), "heads", nbytes),
        ]
    if c.num_experts:
        tokens = B // layout.batch_ways * T // context[1]
        per_layer += _expert_exchange(c, layout, tokens, fwd, platform)
        per_layer.append(PartialSum(1, x, btd, "mlp", nbytes))  # backward: up and gate's input
    else:
        per_layer += [
            PartialSum(down, x, btd, "mlp", nbytes),  # MLP down projection
            PartialSum(1, x, btd, "mlp", nbytes),  # backward: input grad of MLP up
        ]
        if c.style == "llama" and platform == "cpu":  # ... and of the gate (elsewhere summed)
            per_layer.append(PartialSum(1, x, btd, "mlp", nbytes))
    return per_layer + _context_exchange(c, B, *context, pipelined=stages > 1)


def _expert_exchange(
    c: TransformerConfig, layout: Layout, tokens: int, fwd: int, platform: str
) -> list[PartialSum]:
    """One MoE layer's exchange over the expert axes and its experts' down-projection sums
    over the mlp axes, for a device routing `tokens` of its own (jaxdist.parallel.experts);
    `fwd`: how often the forward runs."""
    E, D, K = c.num_experts, c.d_model, c.top_k
    nbytes = jnp.dtype(c.compute_dtype).itemsize
    n_ep = ways(layout.mesh_shape, layout.rules.mesh_axes("expert", "param"))
    rows = dispatch_rows(tokens, E, K, n_ep, c.capacity_factor, c.moe_buffer_factor)
    # The experts' down projection, forward, and its transpose, backward: over the buffer.
    sums = [PartialSum(fwd + 1, (), (rows, D), "mlp", nbytes)]
    if c.capacity_factor is not None:  # dispatch and combine, forward; their transposes
        return sums + [PartialSum(2 * fwd + 2, (), (rows, D), "expert", nbytes, "all-to-all")]
    ragged = platform in dropless.RAGGED_PLATFORMS
    forward, backward = dropless.exchanges(tokens, K, n_ep, c.moe_buffer_factor, ragged)
    sums += [PartialSum(fwd, (), (r, D), "expert", nbytes, kind) for kind, r in forward]
    sums += [PartialSum(1, (), (r, D), "expert", nbytes, kind) for kind, r in backward]
    if n_ep > 1:  # the routing tables: counts and offsets out, offsets and kept rows back
        sums.append(PartialSum(2 * fwd, (), (2, E), "expert", 4, "all-to-all"))
    return sums


def _context_exchange(
    c: TransformerConfig, B: int, strategy: str, cp: int, pipelined: bool
) -> list[PartialSum]:
    """What attention exchanges per layer across a sequence split over `cp` devices
    (jaxdist.parallel.context), with "seq" as the split (PartialSum's `over`); `pipelined`:
    a pipeline's backward tick replays the forward."""
    if cp == 1:
        return []
    T, G, N, H = c.seq_len, c.num_kv_heads, c.num_heads, c.head_dim
    if c.mla:  # keys and values, one per head: their mean width
        H = (c.qk_head_dim + c.v_head_dim) // 2
    nbytes = jnp.dtype(c.compute_dtype).itemsize
    kv_whole = ("batch", None, "kv_heads", "head_dim"), (B, T, G, H)
    if strategy == "all-gather":
        # K and V gathered forward and again for the backward (a gather is never saved:
        # models/remat.py; full remat's replay shares the latter), once more in a pipeline's
        # backward tick, whose replay is a separate forward; gradients reduce-scattered.
        return [
            PartialSum(6 if pipelined else 4, *kv_whole, "seq", nbytes, "all-gather"),
            PartialSum(2, *kv_whole, "seq", nbytes, "reduce-scatter"),
        ]
    # Policies other than none recompute the forward's exchanges in the backward.
    fwd = 1 if c.remat == "none" and not pipelined else 2
    if strategy == "ring":  # cp - 1 hops of K and V forward, of dK and dV backward
        chunk = ("batch", "seq", "kv_heads", "head_dim"), (B, T, G, H)
        return [PartialSum((fwd + 1) * 2 * (cp - 1), *chunk, "seq", nbytes, "collective-permute")]
    if strategy == "ring-by-gather":  # each hop an all-gather of the chunks, backward a sum
        return [
            PartialSum(fwd * 2 * (cp - 1), *kv_whole, "seq", nbytes, "all-gather"),
            PartialSum(2 * (cp - 1), *kv_whole, "seq", nbytes, "reduce-scatter"),
        ]
    # Ulysses: Q and the output [B, T, N, H], K and V (kv heads repeated up to cp), each way.
    g = G * (cp // math.gcd(G, cp))
    heads = (("heads", N), ("kv_heads", g))
    return [
        PartialSum(
            (fwd + 1) * 2,
            ("batch", "seq", h, "head_dim"),
            (B, T, n, H),
            "seq",
            nbytes,
            "all-to-all",
        )
        for h, n in heads
    ]


def activations(c: TransformerConfig, batch_size: int) -> Inventory:
    """What one (micro)batch of `batch_size` rows keeps alive for the backward pass.

    Counted from the residuals JAX saves for this code (jax.ad_checkpoint's saved
    residuals, per layer, at each remat policy) and checked against XLA's memory analysis
    by `jaxdist plan --verify`. MoE layers are approximated as a dense MLP of top_k x
    the rows each active expert multiplies per routed token (_expert_slots) times the width;
    with dense first layers (dense_layers), every layer as one of the mean width. Each
    multi-token prediction module (mtp_depth) holds one such layer's residuals more, beside
    its logits.
    """
    B, T, D, F = batch_size, c.seq_len, c.d_model, c.d_mlp
    N, G, H, V = c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    if c.num_experts:
        F = int(F * c.top_k * _expert_slots(c))
    if c.dense_layers:
        dense_F = c.dense_d_mlp or c.d_mlp
        F = (c.dense_layers * dense_F + (c.num_layers - c.dense_layers) * F) // c.num_layers
    nb = jnp.dtype(c.compute_dtype).itemsize
    btd = Activation(1, ("batch", "seq", "embed"), (B, T, D), nb)
    btd32 = Activation(1, ("batch", "seq", "embed"), (B, T, D), 4)  # the norms' fp32 work
    stat = Activation(1, ("batch", "seq"), (B, T), 4)  # norm statistics stay fp32
    btnh = Activation(1, ("batch", "seq", "heads", "head_dim"), (B, T, N, H), nb)
    btgh = Activation(1, ("batch", "seq", "kv_heads", "head_dim"), (B, T, G, H), nb)
    # XLA's attention computes its logits and softmax in fp32 whatever the input dtype.
    scores = Activation(1, ("batch", "heads", "seq", None), (B, N, T, T), 4)
    score_stat = Activation(1, ("batch", "heads", "seq"), (B, N, T), 4)
    btf = Activation(1, ("batch", "seq", "mlp"), (B, T, F), nb)
    qkv = Activation(
        1, ("batch", "seq", "kv_heads", "qkv", "head_dim"), (B, T, G, N // G + 2, H), nb
    )
    if c.mla:  # the queries and the keys, U wide; the up-projection's keys and values, K + W
        U, X = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim
        btgh = dataclasses.replace(btgh, shape=(B, T, N, U))
        qkv = dataclasses.replace(btnh, shape=(B, T, N, U + X))
    n = dataclasses.replace
    llama = c.style == "llama"
    fused = c.attention in ("cudnn", "splash")
    # Without remat: residual stream, norms and projections (8 of [B,T,D]), norm statistics,
    # q/k/v and the attention output, the scores and softmax, and the MLP's hidden layer
    # with its activation function's intermediates (tanh GELU: 5; SwiGLU: 6).
    everything = (
        # Four in the compute dtype, and each norm's fp32 input and normalized value.
        n(btd, count=4),
        n(btd32, count=4),
        n(stat, count=4),
        n(btnh, count=2 if llama else 3),
        n(btgh, count=2 if llama else 1),
        # XLA's attention materializes scores and softmax; the fused kernels (cuDNN's, splash)
        # keep only the log-sum-exp per row and recompute the rest in their backward.
        n(scores, count=0 if fused else 2),
        n(score_stat, count=1 if fused else 2),
        n(btf, count=6 if llama else 5),
    )
    # The fused attention kernel's output and row statistics, kept by every policy that keeps
    # matmuls (models/remat.py) so the backward never reruns the kernel.
    kernel = (btnh, score_stat) if fused else ()
    # Every policy keeps the layer's input (the scan stacks it), [B, T, D] like the attention
    # output projection's.
    dots = (qkv, n(btd, count=2), n(btf, count=2 if llama else 1)) + kernel
    saved = {
        "none": everything,
        # Matmul outputs: fused QKV, the attention output projection, the MLP's up (and gate).
        "dots": dots,
        # Fused QKV and the attention output projection; the MLP is recomputed.
        "dots_except_mlp": (qkv, n(btd, count=2)) + kernel,
        # dots' set lives in host memory between the passes: only the input stays.
        "offload": (btd,),
        "full": (btd,),  # the layer's input only
    }[c.remat]
    # The backward of one layer: with remat it rebuilds what was not saved, and XLA reuses
    # those buffers for the gradients; without, the gradients need buffers of their own.
    working = (
        everything if c.remat == "none" else everything + tuple(n(t, count=-t.count) for t in saved)
    )
    if c.remat == "offload":
        # While a layer runs, the next one's set is on its way to or from the host.
        working += dots
    # The logits: the head's, and each prediction module's (mtp_depth), all alive for the
    # backward unfused (the fused loss holds one chunk at a time: planning.memory).
    once = (
        n(btd, count=4),
        Activation(1 + c.mtp_depth, ("batch", "seq", "vocab"), (B, T, V), 4),
    )
    if c.mtp_depth:  # each module: one more layer's residuals, its embedding, norms and input
        once += tuple(n(t, count=t.count * c.mtp_depth) for t in saved)
        once += (n(btd, count=5 * c.mtp_depth),)
    return Inventory(saved, working, once)
