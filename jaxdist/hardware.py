"""Peak dense FLOP/s per device, for MFU. Figures are the vendors' datasheet bf16 peaks."""

import jax

# (substring of jax's device_kind, peak bf16 FLOP/s per device)
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops(device: jax.Device, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device; None where unknown (CPUs), so MFU is not invented."""
    if override_tflops is not None:
        return override_tflops * 1e12
    kind = device.device_kind
    for key, flops in PEAK_FLOPS:
        if key in kind:
            return flops
    return None
