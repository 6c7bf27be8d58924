"""`arena-bench`: memory efficiency, capacity, kernel bandwidth and decode throughput. What does the
paged cache buy, and what does it cost, measured?

Here: the CLI (`cli`: `main`, one function per subcommand; `arguments`: its flags; `runner`: the
checks before any work, console, --plot and --json) and each subcommand's measurement (`capacity`
with `allocators`, `arena_sim`, `workload`; `decode` with `hf_peer`; `kernels` and its compile
reports `compile_report`, `compile_report_tpu` with `tpu_steps`; `accuracy`; `prefix`; `swap`;
`serve` with `serve_settings`, `arrivals`), the output (`report`) and helpers (`presets`, `compile_cache`,
`compile_count`). `studies/`: one-question studies and simulations run as `python -m
benchmarks.studies.<name>` (some subcommands call one); their old paths (`benchmarks.code_bounds`,
...) still name the same modules, imported when asked for.
"""
from pallas_kernels._moved import alias

# old module path -> new one (issue 38: studies apart from the subcommands' measurements)
__getattr__ = alias(__name__, {
    f"benchmarks.{name}": f"benchmarks.studies.{name}"
    for name in ("append_cost", "code_bounds", "context_cost", "key_scales_sim", "layer_scaling", "prefix_run_ahead",
                 "smooth_cost", "tpu_host_tier")
})
del alias
