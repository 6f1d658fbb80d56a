"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2): what each depth reads and
predicts at each position. The modules themselves run in models/transformer.py
(predict_ahead); their config and weights are models/transformer_config.py's (mtp_shapes).

At depth k (1..mtp_depth), the position holding token t_p (p its place in the row) combines
the previous depth's hidden state there with the embedding of t_{p+k} and predicts t_{p+k+1}.
Both come from the row itself: the inputs t_0..t_{T-1} and the targets t_1..t_T. The last k
places have no such target; with packed documents, a place whose t_{p+k} opens another document
is left out too, as attention never lets one document see another (the main loss's targets
cross only into the EOS that opens the next document, which depth k still predicts where
t_{p+k} is in the place's own document).

Legend: as models/transformer.py.
"""

import jax
import jax.numpy as jnp

from jaxdist.kernels.documents import Documents


def shifted(
    inputs_BT: jax.Array, targets_BT: jax.Array, docs: Documents | None, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Depth k's tokens at each position: the one it embeds (t_{p+k}), the one it predicts
    (t_{p+k+1}) and whether that target counts (bool). Positions stay where the model has them:
    in the balanced order of a sequence split over devices (docs.index_T, each position's
    place in the row; jaxdist.parallel.context), the row's tokens are looked up by place."""
    T = inputs_BT.shape[1]
    index_T = None if docs is None else docs.index_T
    segments_BT = None if docs is None else docs.segment_ids_BT
    if index_T is None:
        place_T, row = jnp.arange(T), lambda x_BT: x_BT
    else:
        # Row order back from the balanced one: position argsort(index)[p] holds place p.
        place_T, back_T = index_T, jnp.argsort(index_T)
        row = lambda x_BT: x_BT[:, back_T]
    # t_0 .. t_T in row order: the first input, then every target.
    stream_BT1 = jnp.concatenate([row(inputs_BT)[:, :1], row(targets_BT)], axis=1)
    ahead_T = jnp.minimum(place_T + k, T)
    mask_BT = jnp.broadcast_to(place_T + k + 1 <= T, inputs_BT.shape)
    if segments_BT is not None:
        # t_{p+k}'s document (an input's, at place p+k < T where the target exists).
        theirs_BT = row(segments_BT)[:, jnp.minimum(ahead_T, T - 1)]
        mask_BT = mask_BT & (theirs_BT == segments_BT)
    return stream_BT1[:, ahead_T], stream_BT1[:, jnp.minimum(ahead_T + 1, T)], mask_BT
