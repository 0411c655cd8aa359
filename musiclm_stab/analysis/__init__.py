"""Reading runs: run directories and their metrics (runs.py), the study's figures (plot.py lays them out,
curves.py draws the lines and seed bands, style.py the study's look), the claims (claim_stats.py the
statistics, claims.py the table), held-out evaluation per codebook (evaluate.py), linear probes
(probe.py, probe_data.py, probe_fit.py, probe_figure.py)."""
