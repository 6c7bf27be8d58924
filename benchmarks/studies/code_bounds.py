"""What a 4-bit K/V code can reach: the bounds behind issue 20's int4 goal (<= 5% at x20).

    python -m arena_jax.benchmarks.studies.code_bounds [--draws 4000000] [--trials 200] [--seed 0]

`arena-bench accuracy` draws V ~ N(0, 1), and attention over such values passes the values'
relative rms error straight through (part 3 measures it). So a code's rms error on Gaussian
values is a floor under the attention error of any arena that stores values with it, before
the keys add their share. Printed:

1. Codes for N(0, 1) at b bits per element, best first:
   - Shannon's rate-distortion bound, 2^-b: no code of any kind does better;
   - a uniform scalar code with ideal entropy coding, at an entropy of b bits (variable-length
     codes: no page of fixed size can hold them, so this is better than any arena can store);
   - Lloyd-Max: the best fixed-rate scalar code with 2^b levels (Lloyd's iteration on exact
     Gaussian integrals), its rms error exactly and measured on `draws` samples.
2. Codes with a scale per group of 32 lanes (the scale's 16 bits included in the bits per
   element), measured on Gaussian rows: the arena's int4 code (pallas_kernels.quant4: 15 levels
   times the group's absmax / 7, bf16 scales), a 16-level codebook fitted to N(0, 1) times the
   group's rms (the NF4 / TurboQuant idea: a Gaussian codebook after a scale), and the arena's
   layout with 5-bit codes (31 levels).
3. Attention (8 query heads over 90 tokens, head_dim 64, q, k, v ~ N(0, 1), exact keys) with
   the values through each code: the error the values alone leave.
4. The capacity goal: >= 3.5x bf16's tokens leaves 16 / 3.5 = 4.57 bits per stored element,
   keys and values, scales included; what each layout stores.
"""
from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from scipy.special import erfinv, ndtr

from arena_jax.benchmarks.studies.key_scales_sim import HEAD_DIM, attention
from pallas_kernels import quant4

__all__ = ["lloyd_max", "lloyd_max_mse", "entropy_coded_rms", "shannon_rms", "quantize_to_levels", "arena_int4",
           "group_codebook", "group_absmax", "attention_error", "bits_per_element", "CAPACITY_GOAL"]

CAPACITY_GOAL = 3.5  # x bf16's tokens at the same budget (issue 20, item 4)
QUERY_HEADS, TOKENS = 8, 90


def _pdf(t):
    return np.exp(-0.5 * t * t) / np.sqrt(2 * np.pi)


def _cells(thresholds):
    """Edges [-inf, t..., inf] -> (probabilities, centroids) of N(0, 1) in each cell."""
    edges = np.concatenate([[-np.inf], thresholds, [np.inf]])
    p = np.diff(ndtr(edges))
    with np.errstate(invalid="ignore"):
        mass = _pdf(edges[:-1]) - _pdf(edges[1:])  # integral of x phi(x) over the cell
    return p, np.where(p > 0, mass / np.maximum(p, 1e-300), 0.0)


def lloyd_max(bits: int, tol: float = 1e-13, max_iterations: int = 200_000) -> tuple[np.ndarray, np.ndarray]:
    """The 2^bits-level Lloyd-Max code for N(0, 1): (levels [2^b], thresholds [2^b - 1]).

    Lloyd's iteration: thresholds halfway between levels, levels at their cells' centroids
    (exact Gaussian integrals), from levels at the quantiles (i + 1/2) / 2^b."""
    n = 2**bits
    levels = np.sqrt(2) * erfinv(2 * (np.arange(n) + 0.5) / n - 1)
    for _ in range(max_iterations):
        thresholds = (levels[1:] + levels[:-1]) / 2
        new = _cells(thresholds)[1]
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            return levels, (levels[1:] + levels[:-1]) / 2
    raise RuntimeError(f"Lloyd's iteration did not converge for {bits} bits")


def lloyd_max_mse(levels: np.ndarray, thresholds: np.ndarray) -> float:
    """Mean squared error of a code whose levels are its cells' centroids: 1 - sum p_i y_i^2."""
    p, c = _cells(thresholds)
    return float(1.0 - np.sum(p * c * c))


def quantize_to_levels(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Each element of x to its nearest level (levels sorted)."""
    thresholds = (levels[1:] + levels[:-1]) / 2
    return levels[np.searchsorted(thresholds, x)]


def _uniform_code(step: float) -> tuple[float, float]:
    """(output entropy in bits, rms error) on N(0, 1) of the uniform code with cells
    k * step +- step / 2 and centroid reconstruction."""
    k = np.arange(-int(12 / step) - 2, int(12 / step) + 3)
    p, c = _cells((k[:-1] + 0.5) * step)
    used = p[p > 0]
    return float(-np.sum(used * np.log2(used))), float(np.sqrt(max(1.0 - np.sum(p * c * c), 0.0)))


def entropy_coded_rms(bits: float) -> float:
    """rms error on N(0, 1) of the uniform scalar code whose output entropy is `bits` (the step
    by bisection; the entropy falls as the step grows)."""
    lo, hi = 1e-4, 4.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _uniform_code(mid)[0] > bits else (lo, mid)
    return _uniform_code((lo + hi) / 2)[1]


def shannon_rms(bits: float) -> float:
    """Rate-distortion bound for N(0, 1): D(R) = 2^-2R, rms 2^-R."""
    return 2.0**-bits


def arena_int4(x: np.ndarray) -> np.ndarray:
    """x [..., D] through the arena's int4 code (quantize + dequantize, bf16 scales)."""
    packed, scales = quant4.quantize_groups(jnp.asarray(x, jnp.float32))
    return np.asarray(quant4.dequantize_groups(packed, scales), np.float64)


def _groups(x):
    return x.reshape(*x.shape[:-1], -1, quant4.GROUP)


def group_absmax(x: np.ndarray, bits: int) -> np.ndarray:
    """The arena's layout with `bits`-bit codes: symmetric levels times the group's absmax /
    (2^(bits-1) - 1), the scale rounded to bf16, in the arena's float32 arithmetic
    (`pallas_kernels.quant4.quantize_halves`: scale absmax * fl32(1 / top), codes
    round_half_even(x * fl32(1 / stored scale))), so that at 4 bits it is the arena's code (in
    float64 a value halfway between two codes could round the other way)."""
    top = 2 ** (bits - 1) - 1
    g = _groups(x).astype(np.float32)
    scale = np.abs(g).max(-1, keepdims=True) * np.float32(1.0 / top)
    scale = np.asarray(jnp.asarray(scale, jnp.bfloat16), np.float32)
    inv = np.where(scale == 0, np.float32(0), np.float32(1) / np.where(scale == 0, np.float32(1), scale))
    codes = np.round(np.clip(g * inv, -top, top))  # numpy rounds half to even
    return (codes * scale).astype(np.float64).reshape(x.shape)


def group_codebook(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """A codebook after a scale: each group of 32 lanes divided by its rms (rounded to bf16),
    each lane to the nearest of `levels` (fitted to N(0, 1)), times the scale."""
    g = _groups(x)
    scale = np.asarray(jnp.asarray(np.sqrt(np.mean(g * g, -1, keepdims=True)), jnp.bfloat16), np.float64)
    safe = np.where(scale == 0, 1, scale)
    return (quantize_to_levels(g / safe, levels) * scale).reshape(x.shape)


def attention_error(rng: np.random.Generator, code, trials: int) -> float:
    """Mean relative error ||o - o_exact|| / ||o_exact|| of attention over exact keys and
    values through `code` (q, k, v ~ N(0, 1), float64)."""
    errors = []
    for _ in range(trials):
        q, k, v = (rng.standard_normal((m, HEAD_DIM)) for m in (QUERY_HEADS, TOKENS, TOKENS))
        exact = attention(q, k, v)
        errors.append(np.linalg.norm(attention(q, k, code(v)) - exact) / np.linalg.norm(exact))
    return float(np.mean(errors))


def bits_per_element(code_bits: float, scale_bits: int = 16, group: int = quant4.GROUP) -> float:
    return code_bits + scale_bits / group


def _rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b * b)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4_000_000, help="Gaussian samples per measured code")
    parser.add_argument("--trials", type=int, default=200, help="attention draws per code")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("draws", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    rng = np.random.default_rng(args.seed)
    budget = 16 / CAPACITY_GOAL

    print("1. codes for N(0, 1): rms error relative to the values' rms")
    print(f"   {'bits/element':>12} {'Shannon':>8} {'entropy-coded uniform':>22} {'Lloyd-Max exact':>16} {'measured':>9}")
    codes = {}
    x = rng.standard_normal(args.draws)
    for bits in (4, 5, 6):
        levels, thresholds = lloyd_max(bits)
        codes[bits] = levels
        exact = np.sqrt(lloyd_max_mse(levels, thresholds))
        print(f"   {bits:>12} {shannon_rms(bits):>8.2%} {entropy_coded_rms(bits):>22.2%} {exact:>16.2%}"
              f" {_rms(quantize_to_levels(x, levels), x):>9.2%}")
    print(f"   {budget:>12.2f} {shannon_rms(budget):>8.2%} {entropy_coded_rms(budget):>22.2%}"
          f" {'(not an integer)':>16}   <- the capacity goal's budget per element")

    rows = rng.standard_normal((max(args.draws // HEAD_DIM, 1), HEAD_DIM))
    layouts = {
        "arena int4 (15 levels x absmax / 7)": (lambda v: arena_int4(v), bits_per_element(4)),
        "16-level N(0,1) codebook x group rms": (lambda v: group_codebook(v, codes[4]), bits_per_element(4)),
        "5-bit absmax codes (31 levels)": (lambda v: group_absmax(v, 5), bits_per_element(5)),
    }
    print("\n2. codes with a bf16 scale per group of 32 lanes, on Gaussian rows (head_dim 64)"
          f"\n3. attention, {QUERY_HEADS} query heads over {TOKENS} tokens, exact keys, values through the code"
          f" (mean of {args.trials} draws)")
    print(f"   {'code':38} {'bits/element':>12} {'values rms':>10} {'attention':>10}")
    for name, (code, bits) in layouts.items():
        print(f"   {name:38} {bits:>12.2f} {_rms(code(rows), rows):>10.2%} {attention_error(rng, code, args.trials):>10.2%}")

    print(f"\n4. capacity: >= {CAPACITY_GOAL}x bf16's tokens leaves {budget:.2f} bits per element (keys and values)")
    for name, k_bits, v_bits in (("int4 keys and values (the arena)", 4, 4), ("int4 keys, 5-bit values", 4, 5),
                                 ("5-bit keys and values", 5, 5)):
        pair = bits_per_element(k_bits) + bits_per_element(v_bits)
        print(f"   {name:34} {pair:5.1f} bits per K/V pair: {32 / pair:.2f}x bf16's tokens")


if __name__ == "__main__":
    main()
