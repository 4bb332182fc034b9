"""Studies over several runs (ablations, budget maps): their statistics."""
