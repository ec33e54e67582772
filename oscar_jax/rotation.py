"""Orthogonal rotations applied to keys/values as rows: k_rot = k @ R (docs/method.md §1.2).

`compose(U, eigenvalues)` is the published OSCAR rotation R = U · H_D · P:
H_D the orthonormal Sylvester Hadamard matrix and P the bit-reversal
permutation sorted by eigenvalue, i.e. with sigma = argsort(eigenvalues,
descending), column br(i) of R is column sigma(i) of U · H_D.
`identity` and `hadamard` are the ablation baselines. All float32 [D, D].
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def _check_power_of_two(n: int, name: str) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{name}={n}: expected a power of two")


def hadamard(n: int, block: int | None = None) -> jnp.ndarray:
    """Orthonormal Sylvester Hadamard [n, n], or blockdiag of `block`-sized ones."""
    _check_power_of_two(n, "n")
    b = n if block is None else block
    _check_power_of_two(b, "block")
    if n % b:
        raise ValueError(f"block={b} must divide n={n}")
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(b)
    return jnp.asarray(np.kron(np.eye(n // b), h), jnp.float32)


def bit_reversal(n: int) -> np.ndarray:
    """br: int [n] with br[i] = i with its log2(n) bits reversed."""
    _check_power_of_two(n, "n")
    bits = n.bit_length() - 1
    return np.array([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(n)])


def identity(n: int) -> jnp.ndarray:
    return jnp.eye(n, dtype=jnp.float32)


def compose(u: jnp.ndarray, eigenvalues: jnp.ndarray, block: int | None = None) -> jnp.ndarray:
    """Published OSCAR rotation: R [D, D] with R[:, br(i)] = (U · H)[:, sigma(i)].

    u: [D, D] eigenvectors in columns; eigenvalues: [D] (any order);
    block: Hadamard block size (None = full width D, as published).
    """
    d = u.shape[-1]
    if u.shape != (d, d) or eigenvalues.shape != (d,):
        raise ValueError(f"u.shape={u.shape}, eigenvalues.shape={eigenvalues.shape}: expected [D, D] and [D]")
    uh = jnp.asarray(u, jnp.float32) @ hadamard(d, block)
    sigma = jnp.argsort(-jnp.asarray(eigenvalues))
    br = bit_reversal(d)
    return jnp.zeros_like(uh).at[:, br].set(uh[:, sigma])
