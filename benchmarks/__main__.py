from benchmarks.cli import main

raise SystemExit(main())
