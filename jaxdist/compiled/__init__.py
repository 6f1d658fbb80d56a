"""What XLA compiled: the step compiled ahead of time (for TPU and GPU targets this host does
not have, or its own devices), and its program read back: collectives, GEMMs, kernels, memory."""
