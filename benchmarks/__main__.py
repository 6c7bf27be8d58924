from arena_jax.benchmarks.cli import main

raise SystemExit(main())
