"""What the Mosaic GPU (Hopper) kernels ask of the device: whether it runs them, and its SM count."""

from __future__ import annotations

import jax

H200_SMS = 132  # the SM count where the device reports none (interpret mode, lowering)


def device_supported() -> bool:
    """Whether the default device runs the Mosaic GPU kernels: an sm_90 GPU (TMA + wgmma), or
    the CPU (Mosaic GPU interpret mode)."""
    device = jax.devices()[0]
    return device.platform == "cpu" or getattr(device, "compute_capability", None) == "9.0"


def sm_count() -> int:
    """SMs of the default GPU (H200_SMS elsewhere)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or H200_SMS
