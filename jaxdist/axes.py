"""The closed vocabulary of logical axes that models use to name tensor dimensions.

Models never name mesh axes; they name each dimension with one of these logical names, and a
rule table (see jaxdist.rules) maps each name onto zero or more mesh axes.

Shape-suffix legend used throughout the code (x_BTD, logits_BTV, ...):
  B batch      T seq (sequence position)   D embed      F mlp (hidden width)
  N heads      G kv_heads   Q qkv (query heads of a kv group, then K, then V)
  H head_dim   V vocab      L layers     E expert     C capacity (slots per expert)
  K top-k choices of the router
"""

LOGICAL_AXES: tuple[str, ...] = (
    "batch",
    "seq",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "qkv",
    "head_dim",
    "vocab",
    "layers",
    "expert",
)
