"""Which key-scale layout could meet issue 20's accuracy goals? A numpy simulation, not the arena.

    python -m arena_jax.benchmarks.studies.key_scales_sim [--trials 40]

Attention of 4 query heads over 7 / 40 / 90 tokens (head_dim 64; q, k, v ~ N(0, 1); 1 or 4 key
channels x20), error vs float64 over the unquantized K/V (relative Frobenius norm, mean over
trials), for key layouts the arena has (per-token absmax, with and without the Hadamard
rotation) and ones it does not (per-channel scales over a page of 16 tokens, KIVI-style; the
largest channels of each token kept in fp16, KVQuant-style "dense and sparse"; rotated keys
with a scale per group of 16 lanes, values likewise; keys divided by static per-channel
factors calibrated on their first page of tokens, then rotated, SmoothQuant-style). Values keep per-token scales (int8) or
groups of 32 lanes (int4) elsewhere, so the "values only" row is the floor those key layouts
sit on. pallas_kernels/README.md ("Rotated keys") quotes the output.
"""
from __future__ import annotations

import argparse

import numpy as np

HEAD_DIM, QUERY_HEADS, PAGE = 64, 4, 16
TOKENS = (7, 40, 90)


def hadamard_rotation(rng: np.random.Generator, n: int) -> np.ndarray:
    """diag(signs) H / sqrt(n): the arena's rotation (Sylvester order)."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return np.diag(rng.choice([-1.0, 1.0], n)) @ h / np.sqrt(n)


def absmax(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Symmetric absmax codes along `axis`, dequantized."""
    top = 2 ** (bits - 1) - 1
    scale = np.abs(x).max(axis, keepdims=True) / top
    scale[scale == 0] = 1
    return np.round(x / scale) * scale


def per_token(x, bits=8, group=HEAD_DIM):  # [n, D]: one scale per token (per group of lanes)
    return np.concatenate([absmax(x[:, g:g + group], bits, 1) for g in range(0, x.shape[1], group)], 1)


def per_channel(x, bits=8):  # [n, D]: one scale per channel per page of PAGE tokens
    return np.concatenate([absmax(x[i:i + PAGE], bits, 0) for i in range(0, len(x), PAGE)], 0)


def dense_and_sparse(x, keep, bits=8):  # [n, D]: each token's `keep` largest lanes in fp16
    idx = np.argsort(-np.abs(x), 1)[:, :keep]
    rest = x.copy()
    np.put_along_axis(rest, idx, 0, 1)
    out = per_token(rest, bits)
    np.put_along_axis(out, idx, np.take_along_axis(x, idx, 1).astype(np.float16), 1)
    return out


def smoothing(k, calibration=PAGE, alpha=0.5):  # [n, D] -> [D]
    """Static per-channel key factors (SmoothQuant-style, keys divided, queries multiplied: q.k
    unchanged), from the channels' absmax over the first `calibration` tokens: (absmax / median
    absmax) ** alpha, at least 1."""
    amax = np.abs(k[:calibration]).max(0)
    return np.maximum((amax / np.median(amax)) ** alpha, 1.0)


def attention(q, k, v):  # [h, D], [n, D], [n, D] -> [h, D]
    s = q @ k.T / np.sqrt(HEAD_DIM)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def layouts(rot, outliers):
    """name -> (q, k, v) -> attention output over the quantized K/V."""
    v8, v4 = per_token, lambda v: per_token(v, 4, 32)
    return {
        "int8 values only": lambda q, k, v: attention(q, k, v8(v)),
        "int8 per-token": lambda q, k, v: attention(q, per_token(k), v8(v)),
        "int8 per-token + rotation": lambda q, k, v: attention(q @ rot, per_token(k @ rot), v8(v)),
        "int8 groups of 16 + rotation": lambda q, k, v: attention(q @ rot, per_token(k @ rot, 8, 16), per_token(v, 8, 16)),
        "int8 smoothed + rotation": lambda q, k, v: (lambda f: attention((q * f) @ rot, per_token((k / f) @ rot), v8(v)))(
            smoothing(k)),
        "int8 per-channel (page)": lambda q, k, v: attention(q, per_channel(k), v8(v)),
        "int8 dense + sparse fp16": lambda q, k, v: attention(q, dense_and_sparse(k, outliers), v8(v)),
        "int4 values only": lambda q, k, v: attention(q, k, v4(v)),
        "int4 per-token + rotation": lambda q, k, v: attention(q @ rot, per_token(k @ rot, 4, 32), v4(v)),
        "int4 per-channel (page)": lambda q, k, v: attention(q, per_channel(k, 4), v4(v)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--scale", type=float, default=20.0, help="the outlier channels' multiplier")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rot = hadamard_rotation(rng, HEAD_DIM)
    print(f"attention error vs float64, key outlier channels x{args.scale:g}, tokens {TOKENS}")
    for outliers in (1, 4):
        for name, run in layouts(rot, outliers).items():
            errors = []
            for n in TOKENS:
                e = []
                for _ in range(args.trials):
                    q, k, v = (rng.standard_normal((m, HEAD_DIM)) for m in (QUERY_HEADS, n, n))
                    k[:, rng.choice(HEAD_DIM, outliers, replace=False)] *= args.scale
                    ref = attention(q, k, v)
                    e.append(np.linalg.norm(run(q, k, v) - ref) / np.linalg.norm(ref))
                errors.append(np.mean(e))
            print(f"  {outliers} outlier(s)  {name:28s}" + "".join(f"{100 * x:8.2f}%" for x in errors))


if __name__ == "__main__":
    main()
