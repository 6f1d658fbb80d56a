"""Packed documents: ids and positions from the tokens; in the model (GPT-2 and Llama styles,
fp32) no document sees another and positions restart at each, so a packed row is its documents
run one by one; the pipelined step gives the unpipelined loss and gradients with documents."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.kernels import documents
from jaxdist.kernels.loss import cross_entropy
from jaxdist.layout import Layout
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.parallel import pipeline
from jaxdist.rules import activation_rules
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import mesh_for

EOS, VOCAB, T = 256, 384, 32  # document tokens are bytes 0..255; vocab padded past EOS
ROWS = 8  # the batch every forward call here runs (_model)
# GPT-2 (learned positions) and Llama (RoPE, GQA). The quick loop keeps GPT-2: its tests share
# two compiled forward programs (_model); each other model compiles its own.
SLOW_LLAMA = pytest.param("tiny-llama", marks=pytest.mark.slow)


def _content(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(0, EOS, n)]


def test_from_tokens_on_hand_made_rows():
    E = EOS
    tokens_BT = np.array(
        [
            # starts mid-document; a document of length 1 (its EOS alone); ends in an EOS
            [5, 6, E, 1, 2, E, E, 3, 4, E],
            # starts at a document
            [E, 4, 4, 4, E, 7, E, 8, 8, 8],
            # no EOS: one (partial) document
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
        ]
    )
    docs = documents.from_tokens(tokens_BT, E)
    np.testing.assert_array_equal(
        docs.segment_ids_BT,
        [[0, 0, 1, 1, 1, 2, 3, 3, 3, 4], [1, 1, 1, 1, 2, 2, 3, 3, 3, 3], [0] * 10],
    )
    np.testing.assert_array_equal(
        docs.positions_BT,
        [[0, 1, 0, 1, 2, 0, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1, 0, 1, 2, 3], list(range(10))],
    )
    assert docs.segment_ids_BT.dtype == docs.positions_BT.dtype == np.int32
    mask_TS = np.asarray(documents.attention_mask(docs))[0, 0]
    seg_T = np.asarray(docs.segment_ids_BT[0])
    np.testing.assert_array_equal(mask_TS, seg_T[:, None] == seg_T[None, :])
    assert mask_TS[6, 5] == mask_TS[5, 4] == False  # noqa: E712 - the length-1 document
    assert mask_TS[8, 6] and not mask_TS[9, 8]


@functools.cache
def _model(name: str, **overrides):
    """(graphdef, params, apply): apply(params, tokens_BT, packed) -> logits_BTV on one device,
    with the documents from the tokens when `packed`, else the plain model call (no docs).

    Every call runs ROWS rows, the given ones padded with EOS rows and the padding's logits
    dropped (rows do not see each other; MoE only dropless, its default), so that the tests of
    this file compile two programs per model, packed and plain, instead of one per shape."""
    mc = get_model_config(name, vocab_size=VOCAB, **overrides)
    assert mc.compute_dtype == "float32"
    graphdef, params = nnx.split(Transformer(mc, nnx.Rngs(0)))
    mesh = mesh_for("single")

    @functools.partial(jax.jit, static_argnames="packed")
    def run(params, tokens_BT, packed: bool):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            docs = documents.from_tokens(tokens_BT, EOS) if packed else None
            return nnx.merge(graphdef, params)(tokens_BT, docs)[0]

    def apply(params, tokens_BT, packed: bool):
        B, T_ = np.shape(tokens_BT)
        assert B <= ROWS and T_ == T
        padded_BT = np.concatenate([tokens_BT, np.full((ROWS - B, T), EOS)])
        return run(params, padded_BT, packed)[:B]

    return graphdef, params, apply


@pytest.mark.parametrize(
    "name", ["tiny", SLOW_LLAMA, pytest.param("tiny-moe", marks=pytest.mark.slow)]
)
def test_a_document_sees_only_itself_at_positions_from_zero(name):
    # tiny-moe: dropless (its default) on one device, so no expert capacity couples the
    # tokens of a batch (with a capacity, which tokens are dropped depends on all of them).
    _, params, apply = _model(name)
    rng = np.random.default_rng(0)
    a, b = [EOS, *_content(rng, 9)], [EOS, *_content(rng, 13)]
    rest = [EOS, *_content(rng, T - len(a) - len(b) - 1)]
    at_b = slice(len(a), len(a) + len(b))  # document b in the packed rows
    rows_BT = np.array(
        [
            a + b + rest,
            [EOS, *_content(rng, len(a) - 1)] + b + rest,  # document a changed
            b + rest + a,  # b alone at the start of a row
        ]
    )
    logits_BTV = np.asarray(apply(params, rows_BT, packed=True))
    assert np.abs(logits_BTV[0, : len(a)] - logits_BTV[1, : len(a)]).max() > 1e-3
    np.testing.assert_array_equal(logits_BTV[1, at_b], logits_BTV[0, at_b])
    # Positions restart: b in the middle of a row is b at the start of one, packed or through
    # the plain call (logits below 1 in size). Not asserted bitwise, as the masked-out keys sit
    # elsewhere in the reductions; on CPU (jax 0.11.2) the three are bitwise equal all the same.
    np.testing.assert_allclose(logits_BTV[2, : len(b)], logits_BTV[0, at_b], rtol=0, atol=1e-5)
    plain_BTV = np.asarray(apply(params, rows_BT, packed=False))
    np.testing.assert_allclose(plain_BTV[2, : len(b)], logits_BTV[0, at_b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", SLOW_LLAMA])
def test_packed_loss_is_the_token_weighted_mean_of_the_documents_alone(name):
    """Targets: input token t of a row predicts token t+1. A document owns the targets of its
    input tokens, from its EOS through its last token, which predicts the EOS that opens the
    next document (that EOS ends it). The row's leading partial document owns the targets up
    to the first EOS, and the last document those up to the row's end (its last target is the
    row's last token, its end cut off). Run alone, a document's tokens (its inputs and the one
    target after them) start a row filled up with anything (causal: nothing after counts), and
    go through the plain model call. The packed row's mean over its B*T targets is then the
    mean of the documents' own means weighted by their numbers of targets (measured on CPU:
    equal within 1.3e-7 relative)."""
    _, params, apply = _model(name)
    rng = np.random.default_rng(1)
    rows_BT1 = np.array(
        [
            # partial document, one of 9, one of length 1, one cut off by the row's end
            _content(rng, 5) + [EOS, *_content(rng, 8)] + [EOS] + [EOS, *_content(rng, 17)],
            [EOS, *_content(rng, 11)] + [EOS, *_content(rng, 3)] + [EOS, *_content(rng, 16)],
        ]
    )
    assert rows_BT1.shape == (2, T + 1)
    packed_BTV = apply(params, rows_BT1[:, :-1], packed=True)
    packed_loss = float(cross_entropy(packed_BTV, rows_BT1[:, 1:]))

    pieces, alone_BT1 = [], []
    for row_T1 in rows_BT1:
        seg_T = np.asarray(documents.from_tokens(row_T1[None, :-1], EOS).segment_ids_BT[0])
        for s in np.unique(seg_T):
            start, stop = np.flatnonzero(seg_T == s)[[0, -1]] + [0, 1]  # inputs [start, stop)
            doc_T1 = row_T1[start : stop + 1]  # its inputs and, one on, its targets
            pieces.append(stop - start)
            alone_BT1.append(np.concatenate([doc_T1, _content(rng, T + 1 - len(doc_T1))]))
    assert sorted(pieces) == [1, 4, 5, 9, 12, 16, 17]
    alone_BT1 = np.array(alone_BT1)
    alone_BTV = apply(params, alone_BT1[:, :-1], packed=False)
    ce_BT = np.asarray(optax.softmax_cross_entropy_with_integer_labels(alone_BTV, alone_BT1[:, 1:]))
    doc_losses = [ce_BT[d, :n].mean() for d, n in enumerate(pieces)]
    weighted = np.average(doc_losses, weights=pieces)
    np.testing.assert_allclose(packed_loss, weighted, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["tiny", SLOW_LLAMA])
def test_a_row_without_eos_is_the_plain_model(name):
    # Through the docs path a row without EOS is one document at positions 0..T-1: the same
    # logits as the mask-free call (the fast path, with no mask argument at all); bitwise on
    # CPU, asserted to 1e-6.
    _, params, apply = _model(name)
    tokens_BT = np.random.default_rng(2).integers(0, EOS, (2, T))
    plain_BTV = np.asarray(apply(params, tokens_BT, packed=False))
    packed_BTV = np.asarray(apply(params, tokens_BT, packed=True))
    np.testing.assert_allclose(packed_BTV, plain_BTV, rtol=0, atol=1e-6)


def _by_name(grads) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(grads)
    return {path[0].key: np.asarray(g) for path, g in flat}


# The data-parallel and tensor-parallel case puts the documents' ids and mask under a batch
# split inside the pipeline's shard_map.
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, layout", [("tiny", "pipeline=2"), ("tiny-llama", "pipeline=2,data=2,tensor=2")]
)
def test_pipelined_documents_equal_unpipelined(name, layout):
    M, rows = 2, 4
    graphdef, params, apply = _model(name)
    rng = np.random.default_rng(3)
    tokens_BT1 = rng.integers(0, EOS, (rows, T + 1))
    tokens_BT1[rng.random((rows, T + 1)) < 0.15] = EOS  # documents of random lengths
    single = mesh_for("single")

    @jax.jit
    def reference(params, tokens_BT1):
        def loss_fn(params):
            inputs_BT = tokens_BT1[:, :-1]
            docs = documents.from_tokens(inputs_BT, EOS)
            logits_BTV, _ = nnx.merge(graphdef, params)(inputs_BT, docs)
            return cross_entropy(logits_BTV, tokens_BT1[:, 1:])

        with activation_rules(Layout.on(single, STANDARD_RULES), single):
            return jax.value_and_grad(loss_fn)(params)

    mesh = build_mesh(parse_mesh(layout), jax.devices()[: 2 if layout == "pipeline=2" else 8])
    schedule = pipeline.make_schedule("1f1b", 2, M)

    @jax.jit
    def pipelined(params, tokens_BT1):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            stages = nnx.merge(graphdef, params).stages()
            loss = lambda w, y_bTD, t_bT: cross_entropy(stages.head(w, y_bTD), t_bT)  # noqa: E731
            return pipeline.value_and_grad(stages, tokens_BT1, loss, 1.0, schedule, M, eos_id=EOS)

    ref_loss, ref_grads = reference(params, tokens_BT1)
    # The rows really are packed: seen as one sequence each, their loss is another (the plain
    # forward call of the tests above, compiled once).
    unpacked_loss = cross_entropy(
        apply(params, tokens_BT1[:, :-1], packed=False), tokens_BT1[:, 1:]
    )
    assert abs(float(unpacked_loss) - float(ref_loss)) > 1e-4 * float(ref_loss)
    on_mesh = NamedSharding(mesh, P())
    loss, grads, aux = pipelined(
        jax.device_put(params, on_mesh), jax.device_put(tokens_BT1, on_mesh)
    )
    assert float(aux) == 0  # a dense model's stages add no auxiliary loss
    # Measured on CPU: loss within 1e-7 relative; each gradient within 7e-7 of its largest
    # element (the same as without documents: the microbatches' sums in another order).
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    ref_grads = _by_name(ref_grads)
    assert set(grads) == set(ref_grads)
    for k, g in grads.items():
        ref = ref_grads[k]
        np.testing.assert_allclose(
            np.asarray(g), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=k
        )
