"""Many processes, one run: joining JAX's distributed runtime, launching on one host, the
slow-step watchdog, and Slurm and Kubernetes files."""
