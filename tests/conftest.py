"""Test-wide setup (must precede jax import): 8 host CPU devices for the sharding tests, and
XLA:CPU's LLVM optimisation off. The suite is compile-bound (hundreds of distinct programs,
interpret-mode kernels among them), and level 0 compiles about 2x faster while running these
small programs no slower overall (an interpret-mode Mosaic GPU case 10.0 -> 7.0 s, the
every-scheme evaluate test 36 -> 28 s); it changes codegen only, not IEEE float semantics."""

import os

for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
