"""The key rotation of quantized arenas: a fixed, randomized Hadamard transform per head.

Keys with a few outlier channels (10-50x the rest, as real LLM keys have) set the absmax of
every row they appear in, so with per-row (or per-group) scales every other channel gets
coarse steps. An orthogonal rotation R spreads each outlier over all channels before the
keys are quantized; attention rotates q by the same R, and since R R^T = I the scores are
unchanged: (q R) . (k R) = q . k (up to rounding). Values are not rotated.

    R = diag(s) H / sqrt(n)      H: a Hadamard matrix (entries +-1, H H^T = n I), n = head_dim
                                 s: a fixed pseudo-random sign vector (splitmix64 of a constant)

A row x (a key, a query) is rotated as `(x @ M) * col_scale` with M = diag(s) H (entries
+-1, so products with any float input are exact and only the f32 sums round) and
col_scale = 1 / sqrt(n) per column: `rotation(head_dim)` returns both.

Which Hadamard matrix. head_dim a power of two: Sylvester's. Otherwise (96, 80, 112, ...) a
true Hadamard matrix of order head_dim when one is constructed here: Sylvester x Paley I
(order q + 1, q a prime = 3 mod 4) or Sylvester x Paley II (order 2 (q + 1), q a prime =
1 mod 4), which covers every multiple of 8 up to 256 except 184 and 232; e.g. 96 = 8 x 12
(Paley I, q = 11), 80 = 4 x 20 (q = 19), 112 = 4 x 28 (Paley II, q = 13). Those two and any
order without a construction fall back to a block-diagonal matrix over power-of-two blocks
(the binary decomposition, largest first: 184 = 128 + 32 + 16 + 8), which spreads an outlier
only within its block. The kernels apply M as a dense [head_dim, head_dim] product (on a GPU:
tensor-core dots, cheaper than a butterfly network's lane shuffles), so any orthogonal M
costs the same; `block_sizes(head_dim)` says which one a head size gets.

One rotation for every layer and KV head (GQA: q heads use their KV head's, which is the
same); it is a pure function of head_dim, so an arena's contents mean the same in every
process and after a restart.
"""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["rotation", "hadamard", "block_sizes", "sign_vector", "rotate_rows"]

_SEED = 0x5EED_A7E4A_0020  # any constant: the signs must never change (arenas store rotated keys)


def sign_vector(n: int) -> np.ndarray:
    """n fixed pseudo-random signs (+-1, float32) from splitmix64: independent of numpy's generators."""
    out = np.empty(n, np.float32)
    state = _SEED
    mask = (1 << 64) - 1
    for i in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out[i] = 1.0 if z >> 63 else -1.0
    return out


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = chi(j - i), chi the quadratic character mod the prime q."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if x in squares else -1 for x in range(1, q)], np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> np.ndarray:
    """Order q + 1 (q prime, q = 3 mod 4): H = I + S, S = [[0, 1^T], [-1, Q]] skew, S S^T = q I."""
    n = q + 1
    s = np.zeros((n, n), np.int64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return np.eye(n, dtype=np.int64) + s


def _paley2(q: int) -> np.ndarray:
    """Order 2 (q + 1) (q prime, q = 1 mod 4): the symmetric conference matrix C with 0 -> [[1, -1],
    [-1, -1]] and +-1 -> +-[[1, 1], [1, -1]]."""
    n = q + 1
    c = np.zeros((n, n), np.int64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    return np.kron(c, np.array([[1, 1], [1, -1]])) + np.kron(np.eye(n, dtype=np.int64), np.array([[1, -1], [-1, -1]]))


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _core(m: int) -> np.ndarray | None:
    """A Paley Hadamard matrix of order m, or None."""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    return None


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n (int64, +-1, H H^T = n I) built here, or None."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return _sylvester(n)
    two = 1
    while n % (2 * two) == 0:
        two *= 2
    while two >= 1:  # the largest Paley core first (spreads the same: any Hadamard of order n does)
        core = _core(n // two)
        if core is not None:
            return np.kron(_sylvester(two), core)
        two //= 2
    return None


def block_sizes(head_dim: int) -> tuple[int, ...]:
    """The diagonal blocks of the rotation: (head_dim,) when a Hadamard matrix of that order is
    built here, else the binary decomposition of head_dim (largest block first)."""
    if hadamard(head_dim) is not None:
        return (head_dim,)
    return tuple(1 << b for b in reversed(range(head_dim.bit_length())) if head_dim >> b & 1)


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    m = np.zeros((head_dim, head_dim), np.float32)
    col_scale = np.zeros(head_dim, np.float32)
    start = 0
    for n in block_sizes(head_dim):
        h = hadamard(n)
        m[start : start + n, start : start + n] = h
        col_scale[start : start + n] = np.float32(1.0 / np.sqrt(n))
        start += n
    m *= sign_vector(head_dim)[:, None]  # diag(s) @ H: row i of M is s_i H[i]
    m.setflags(write=False)
    col_scale.setflags(write=False)
    return m, col_scale


def rotation(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(M f32[head_dim, head_dim] with entries +-1 or 0, col_scale f32[head_dim]): a row x
    rotates to `(x @ M) * col_scale`, an orthogonal map (read-only arrays, cached)."""
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return _rotation(head_dim)


def rotate_rows(x, dtype=None):
    """x [..., D] -> x rotated, in float32 (`dtype` given: rounded to it), as the kernels do it:
    the product with M in float32 (exact products, f32 sums), then the column scale in f32."""
    import jax
    import jax.numpy as jnp

    m, col_scale = rotation(int(x.shape[-1]))
    y = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), jnp.asarray(m), precision=jax.lax.Precision.HIGHEST)
    # The barrier keeps XLA from merging the column scale with a later scaling (the quantizer's
    # 1 / scale: XLA's simplifier turns (y * c) * inv into y * (c * inv), in some programs and
    # not others), so the same keys rotate to the same bits, and codes, in every program.
    y = jax.lax.optimization_barrier(y * jnp.asarray(col_scale))
    return y if dtype is None else y.astype(dtype)
