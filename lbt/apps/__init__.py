"""The commands on top of the engine: compose (the one config composer), cli, study, tune, report, plan.

The only layer that imports hydra, omegaconf, argparse, matplotlib or optuna.
"""
