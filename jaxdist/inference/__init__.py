"""Using a trained model: a run opened on a mesh (runs.py: its weights alone, their held-out
loss), and generation on a mesh from a model's KV cache (prefill, then one token at a time),
greedy or sampled. A side system: the train step never imports it."""
