"""Hydra sweeper `lds_optuna`: Optuna (>= 4) search with pruning, asynchronous trials and resumable studies."""
