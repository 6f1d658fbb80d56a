"""Rotary position frequencies: the plain rotary embedding and the scaled variants Hugging Face
configs name (`rope_type` llama3, linear, dynamic, yarn), computed as transformers'
ROPE_INIT_FUNCTIONS compute them (transformers.modeling_rope_utils), once per config.

A config keeps its scaling as `rope_scaling`: the HF dict's items (rope_type and its
parameters, without rope_theta), a hashable tuple; empty for the plain embedding.

Legend: H head_dim, H2 = H / 2 frequencies.
"""

import math

import numpy as np

from jaxdist.errors import ConfigError

SUPPORTED = ("default", "llama3", "linear", "dynamic", "yarn")
# What each kind needs beyond `factor` (llama3's low/high-frequency factors, yarn's optional
# knobs have transformers' defaults below).
_NEEDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
}


def from_hf(hf: dict, where: str) -> tuple[float, tuple]:
    """(rope_theta, rope_scaling) of a config.json: `rope_parameters` (transformers 5) or
    `rope_scaling` with a top-level `rope_theta` (earlier configs), either spelling of the
    kind (`rope_type`, or `type`)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10_000.0)))
    if kind not in SUPPORTED:
        raise ConfigError(
            f"{where}: RoPE type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor (RoPE on part of each head) is not supported"
        )
    if kind == "default":
        return theta, ()
    missing = [k for k in _NEEDS[kind] if rope.get(k) is None]
    if kind == "yarn" and rope.get("original_max_position_embeddings") is None:
        missing.append("original_max_position_embeddings")
    if missing:
        raise ConfigError(f"{where}: RoPE type {kind!r} needs {', '.join(missing)}")
    if kind == "dynamic":  # the context the frequencies stay unscaled up to
        rope["original_max_position_embeddings"] = hf["max_position_embeddings"]
    rope.pop("partial_rotary_factor", None)
    return theta, (("rope_type", kind), *sorted(rope.items()))


def to_hf(theta: float, scaling: tuple) -> dict:
    """The `rope_parameters` of config.json for (theta, scaling)."""
    return {"rope_type": "default", "rope_theta": theta} | dict(scaling)


def check_length(scaling: tuple, seq_len: int) -> None:
    """Dynamic NTK scaling changes the frequencies with the length of each input past the
    original context: within it they are the plain ones, the only ones computed here."""
    s = dict(scaling)
    if s.get("rope_type") == "dynamic" and seq_len > s["original_max_position_embeddings"]:
        raise ConfigError(
            f"dynamic RoPE scaling is supported up to its original context "
            f"({s['original_max_position_embeddings']} tokens), not {seq_len}; pass a shorter "
            "--seq-len"
        )


def inv_freq(theta: float, scaling: tuple, H: int) -> np.ndarray:
    """The H/2 inverse frequencies (float32), transformers' for this config."""
    exponents = np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / np.float32(H)
    base = (1.0 / (np.float64(theta) ** exponents.astype(np.float64))).astype(np.float32)
    s = dict(scaling)
    kind = s.get("rope_type", "default")
    if kind in ("default", "dynamic"):  # dynamic: within the original context (check_length)
        return base
    if kind == "linear":
        return (base / np.float32(s["factor"])).astype(np.float32)
    if kind == "llama3":
        return _llama3(base, s)
    return _yarn(theta, H, s)[0]


def attention_scale(scaling: tuple) -> float:
    """The factor cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
    s = dict(scaling)
    return _yarn_attention_factor(s) if s.get("rope_type") == "yarn" else 1.0


def _llama3(base: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > old / low, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, m, m_all = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all))
    return yarn_mscale(factor)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """transformers' yarn_get_mscale: yarn's attention temperature for a context `scale`."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(theta: float, H: int, s: dict) -> tuple[np.ndarray, float]:
    factor, old = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (H * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos = np.float32(theta) ** (np.arange(0, H, 2).astype(np.float32) / np.float32(H))
    ramp = np.clip((np.arange(H // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv.astype(np.float32), _yarn_attention_factor(s)
