"""What the Mosaic GPU (Hopper) kernels share: whether the device runs them, its SM count, and
the shared-memory layout of their wgmma operands."""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

H200_SMS = 132  # the SM count where the device reports none (interpret mode, lowering)


def device_supported() -> bool:
    """Whether the default device, where it is a GPU, runs the Mosaic GPU kernels: sm_90 (TMA +
    wgmma). Off a GPU (lowering for CUDA, interpret mode) the target is taken to be Hopper, as
    for `sm_count`."""
    device = jax.devices()[0]
    return device.platform != "gpu" or getattr(device, "compute_capability", None) == "9.0"


def sm_count() -> int:
    """SMs of the default GPU (H200_SMS elsewhere)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or H200_SMS


def int8_tiles(minor: int) -> tuple:
    """Shared-memory transforms of an int8 MMA operand whose rows have `minor` bytes."""
    swizzle = min(minor, 128)
    return plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)


def bf16_tiles(minor: int) -> tuple:
    """Shared-memory transforms of a bf16 MMA operand whose rows have `minor` elements."""
    swizzle = min(2 * minor, 128)
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)
