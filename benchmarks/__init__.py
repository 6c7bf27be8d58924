"""`arena-bench`: memory efficiency, capacity, kernel bandwidth and decode throughput."""
