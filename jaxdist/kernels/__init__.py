"""The step's kernels, stage 2 (compute forward/backward): attention by platform (cuDNN, splash,
XLA), the next-token loss (plain, or fused so that it never holds the whole logits), the
embedding lookup, and packed documents (the ids and positions both of them respect)."""
