"""`lbt plan`: how long one epoch takes on W workers, before you rent them.

The formulas are lbt/cost/; this package reads its settings (`plan.KEY=VALUE`, settings.py), measures, predicts
(a GPU preset) or reads a worker's compute (compute.py), evaluates the formulas over W, and prints and draws the
answer (output.py, cli.py).
"""
