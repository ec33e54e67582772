"""Test-wide setup (must precede jax import): 8 host CPU devices for the sharding tests, and
XLA:CPU's LLVM optimisation off. The suite is compile-bound (hundreds of distinct programs,
interpret-mode kernels among them), and level 0 compiles about 2x faster while running these
small programs no slower overall (an interpret-mode Mosaic GPU case 10.0 -> 7.0 s, the
every-scheme evaluate test 36 -> 28 s); it changes codegen only, not IEEE float semantics.

The compiled GPU tests (marker `gpu`) come in groups, one marker each (`GPU_GROUPS`; the
commands: the docstrings of tests/test_gpu_kernels.py (gpu_triton, gpu_write) and
tests/test_mgpu_kernels.py (gpu_mgpu, gpu_decode, gpu_decode_parts)). When a run selects any
of them, JAX's persistent compilation cache keeps their compilations in build/jax_cache
across runs."""

import os
import pathlib
import re

for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

GPU_GROUPS = {
    "gpu_triton": "the Triton attention kernel compiled on a GPU",
    "gpu_mgpu": "the Mosaic GPU decode kernel at D = 128 compiled on a Hopper GPU",
    "gpu_decode": "the Mosaic GPU decode at D = 64 and 256, production windows and 'auto' on a GPU",
    "gpu_decode_parts": "decode_start and decode_finish compiled on a GPU",
    "gpu_write": "the bulk writes (Triton, Mosaic GPU), write_prompt and the append kernel compiled on a GPU",
    "gpu_serving": "the decoder's prefill and decode (cuDNN, Mosaic GPU) against XLA on a GPU",
}
COMPILATION_CACHE = pathlib.Path(__file__).resolve().parents[1] / "build" / "jax_cache"


def pytest_configure(config):
    for name, what in GPU_GROUPS.items():
        config.addinivalue_line("markers", f"{name}: {what} (also marked gpu)")
    if re.search(r"(?<!not )\bgpu", config.getoption("markexpr") or ""):  # compiled GPU tests selected
        import jax

        jax.config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
