"""Rotations: orthogonality and the published U·H·P placement (docs/method.md §1.2)."""

import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import rotation


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
def test_hadamard_orthonormal(n):
    h = np.asarray(rotation.hadamard(n), np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-6)


def test_block_hadamard_is_block_diagonal():
    h = np.asarray(rotation.hadamard(16, block=4))
    # all 4 blocks, zeros elsewhere
    np.testing.assert_array_equal(h, np.kron(np.eye(4), np.asarray(rotation.hadamard(4))))
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)


def test_bit_reversal_by_hand():
    assert rotation.bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert rotation.bit_reversal(4).tolist() == [0, 2, 1, 3]


def test_compose_placement_by_hand():
    """D = 4, U = I, eigenvalues [1, 4, 2, 3]: sigma = [1, 3, 2, 0], br = [0, 2, 1, 3],
    so R[:, 0] = H[:, 1], R[:, 2] = H[:, 3], R[:, 1] = H[:, 2], R[:, 3] = H[:, 0]."""
    h = 0.5 * np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])
    expected = np.stack([h[:, 1], h[:, 2], h[:, 3], h[:, 0]], axis=1)
    r = rotation.compose(jnp.eye(4), jnp.array([1.0, 4.0, 2.0, 3.0]))
    np.testing.assert_allclose(np.asarray(r), expected, atol=1e-7)


@pytest.mark.parametrize("d, block", [(64, None), (128, None), (64, 16)])
def test_compose_orthogonal(d, block):
    rng = np.random.default_rng(d)
    a = rng.standard_normal((d, d))
    lam, u = np.linalg.eigh(a @ a.T)
    r = np.asarray(rotation.compose(jnp.asarray(u, jnp.float32), jnp.asarray(lam, jnp.float32), block),
                   np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)


def test_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        rotation.hadamard(12)
