"""Reading runs: run directories and their metrics (runs.py), the study's figures (plot.py), held-out
evaluation per codebook (evaluate.py)."""
