"""Serving a trained model: generation on a mesh from a model's KV cache (prefill, then one
token at a time), greedy or sampled. A side system: the train step never imports it."""
