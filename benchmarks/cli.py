"""arena-bench (placeholder until the benchmark CLI lands): the layout report of built-in configs."""
from __future__ import annotations

import arena_jax as aj

PRESETS = {
    "mistral-7b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama3-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128),
}


def main(argv=None) -> int:
    budget = 40 * 2**30
    print(f"{'model':<12} {'bytes/token':>12} {'pages (40 GiB, 16 tok)':>24} {'tokens':>12}")
    for name, geo in PRESETS.items():
        layout = aj.KVLayout.for_memory_budget(**geo, budget_bytes=budget, page_size=16)
        print(f"{name:<12} {layout.bytes_per_token:>12,} {layout.num_pages:>24,} {layout.token_capacity:>12,}")
    return 0
