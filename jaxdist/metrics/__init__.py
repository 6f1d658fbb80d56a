"""What a run records about itself: metrics.jsonl and the summary (records), each step's time,
throughput and MFU (steptimer), TensorBoard event files (tensorboard), and where the wall-clock
went across attempts (goodput)."""
