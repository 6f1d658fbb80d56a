"""The step's kernels, stage 2 (compute forward/backward): attention by platform (cuDNN, splash,
XLA), the fused cross-entropy that never holds the whole logits, and packed documents (the ids
and positions both of them respect)."""
