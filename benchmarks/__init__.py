"""`arena-bench`: memory efficiency, capacity, kernel bandwidth and decode throughput. What does the
paged cache buy, and what does it cost, measured?

Here: the CLI (`cli`: `main`, one function per subcommand; `arguments`: its flags; `runner`: the
checks before any work, console, --plot and --json) and each subcommand's measurement (`capacity`
with `allocators`, `arena_sim`, `workload`; `decode` with `hf_peer`; `kernels` and its compile
reports `compile_report`, `compile_report_tpu` with `tpu_steps`; `accuracy`; `prefix`; `swap`;
`serve` with `serve_settings`, `arrivals`), the output (`report`) and helpers (`presets`, `compile_cache`,
`compile_count`). `studies/`: one-question studies and simulations run as `python -m
arena_jax.benchmarks.studies.<name>` (some subcommands call one); their old paths
(`benchmarks.code_bounds`, ...) still name the same modules, imported when asked for.

This folder installs as `arena_jax.benchmarks`; in a source checkout `import benchmarks` is this
package too (old paths, like `python -m benchmarks.studies.<name>`, keep working there).
"""
from pallas_kernels._moved import alias, alias_tree

if __name__ == "benchmarks":  # imported by its old top-level name (a source checkout)
    alias_tree("benchmarks", "arena_jax.benchmarks")

# old module path -> new one (issue 38: studies apart from the subcommands' measurements)
__getattr__ = alias(__name__, {
    f"{__name__}.{name}": f"{__name__}.studies.{name}"
    for name in ("append_cost", "code_bounds", "context_cost", "key_scales_sim", "layer_scaling", "prefix_run_ahead",
                 "smooth_cost", "tpu_host_tier")
})
del alias
