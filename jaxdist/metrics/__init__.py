"""What a run records about itself: metrics.jsonl and the summary (records), each step's time,
throughput and MFU (steptimer), the step lines and the terminal's progress bar (progress),
TensorBoard event files (tensorboard), where the wall-clock went across attempts (goodput),
the compiles JAX reports (compiles), and the replica groups' outer rounds (outer)."""
