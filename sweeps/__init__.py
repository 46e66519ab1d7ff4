"""Sweeps: Optuna studies whose trials are `launch.py` processes (docs/sweeps.md).

  runner.py       the sweep file (`get_sweep()`), its trials' commands, the workers that run them
  studies.py      the Optuna side: storages, samplers, pruners, the trial budget, heartbeats
  evaluations.py  a running trial's evaluations, read from its metrics.jsonl and reported to Optuna
  report.py       the results: sweep.csv, sweep.md, the plots, the best trial

A sweep stands above training: it starts trainings as processes and reads what they log. It may
import `train/` and the layers below it; only launch.py, scripts/ and tests/ import it, and no layer
below it uses Optuna (tests/test_layering.py checks all three).
"""
