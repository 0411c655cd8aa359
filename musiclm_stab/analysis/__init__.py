"""Reading runs: run directories and their metrics (runs.py), the study's figures (plot.py lays them out,
figure_specs.py says which figures and their axes, panels.py draws each figure's panels, curves.py the lines
and seed bands, style.py the study's look), the claims (claim_stats.py the per-run statistics, decide.py the
exact tests and verdicts, claims.py the claims table, lr_grid.py the learning-rate grid and "learns"),
held-out evaluation per codebook (evaluate.py), linear probes (probe.py, probe_data.py, probe_fit.py,
probe_figure.py), a sweep's sensitivity, table and figure (sweep_report.py) and a study's codes record
(study_record.py), which the jobs in experiments/ use too."""
