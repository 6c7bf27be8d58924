"""Studies: one question each about the cache, answered by a measurement or a simulation that is not
an `arena-bench` subcommand (run as `python -m arena_jax.benchmarks.studies.<name>`; RESULTS.md has their
answers). Which design did the figures choose, and why?

`append_cost` (append against the arena's capacity), `context_cost` (does attention follow the
context or the capacity?), `layer_scaling` (compile and step time against depth; `arena-bench
serve` uses its `measure`), `prefix_run_ahead` (run-ahead decode with a prefix cache),
`smooth_cost` (what smoothed keys cost a step), `tpu_host_tier` (host-tier ops compiled for a v5e:
a page or the whole arena?), `op_hlo` (where a paged step's compile time goes: HLO
instructions, kernels and compile time per cache op), `key_scales_sim` (which key-scale layout, a numpy simulation) and
`code_bounds` (what a 4-bit code can reach).
"""
