"""Whole jobs made of the other parts: the main job (quickstart.py), the stability study (study.py), the
learning-rate sensitivity sweep (sweep.py), and what they share: the default data and launching a run (launch.py)."""
