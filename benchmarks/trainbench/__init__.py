"""Side-by-side training benchmark: workload, engine adapters, child worker, report."""
