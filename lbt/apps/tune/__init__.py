"""`lbt tune`: the same tuning budget for every (recipe, global batch) cell, chosen on val.

Comparing a hand-tuned recipe with an untuned baseline measures tuning effort, not the
batch size (Shallue et al. 2019; Nado et al. 2021, "A Large Batch Optimizer Reality
Check"). `lbt tune` runs one protocol for every cell of a grid:

    for cell in the grid (tune.grid in conf/tune/default.yaml, or the command line's sweeps):
      for each of tune.studies independent searches (own sampler seed; 1 by default):
        until tune.trials trials of the search finished or were pruned:
            values = TPE or quasi-random (seeded).sample(the recipe's tune.space)   # recipes/*.yaml
            result = lbt.engine.run(make_spec(config + values))     # in this process, as `lbt train`
                after each evaluation: val acc (or loss) -> the trial; the pruner may stop it (PruneOnVal)
            value  = final_val_acc, or 0 if the run diverged (it spent the budget all the same);
                     with tune.metric=loss final_val_loss, minimised, or inf if it diverged;
                     with tune.objective=steps_to_target the steps to tune.target, inf if missed
            recorded: its val curve, from which the report reads steps to the target
    for cell: the best values of the median search, and the recipe's untuned defaults, each trained
        with tune.seeds fresh seeds and scored on val and, once, on test
    tune_report.md (with steps to target per cell and the fitted critical batch per recipe),
        tune_summary.json, best_lr_vs_batch.png, steps_to_target.png (steps to the target vs global batch)

The trials live in an Optuna storage (tune.storage: SQLite in tune.dir by default, a journal file,
or a database server; storage.py), one Optuna study per cell and search, so the same command again runs only
what is missing and `optuna-dashboard sqlite:///<dir>/optuna.db` shows them. Many workers (tune.workers,
or several `lbt tune` commands on one tune.dir) share the trials of every cell: workers.py. Folder layout:

    <tune.dir>/optuna.db
    <tune.dir>/trials/<cell>/<number>/           a trial's run folder (no result.json if pruned)
    <tune.dir>/trials/<cell>/study_<k>/<number>/ the same, in the cell's k-th search (k >= 2)
    <tune.dir>/final/tuned/<cell>/seed_<s>/      the best values, seed s
    <tune.dir>/final/default/<cell>/seed_<s>/    the recipe's defaults, seed s
                                                 (`lbt report <tune.dir>/final`: tuned vs untuned, per recipe)
    <tune.dir>/tune_report.md, tune_summary.json, best_lr_vs_batch.png, steps_to_target.png

grid.py reads the command line into cells, trials.py runs a cell's trials, finals.py its final runs,
report.py writes the report (summary.py: the typed shapes of the cells' and the report's JSON files),
storage.py opens the trials' storage, workers.py is each worker's loop;
command.py ties them together. Optuna is optional (`lbt[tune]`), so it is
imported only once `lbt tune` is asked for.
"""

from __future__ import annotations

from lbt.apps.errors import fail
from lbt.errors import ConfigError

HELP = """usage: lbt tune [overrides]

The same tuning budget for every (recipe, world size) cell: tune.trials Optuna trials per cell
(TPE, seeded; a pruner fed the val accuracy), each an `lbt train` run selected on val; then the best
values and the recipe's untuned defaults with tune.seeds fresh seeds, scored once on test.
Writes tune_report.md, tune_summary.json, best_lr_vs_batch.png, steps_to_target.png and optuna.db into tune.dir;
the same command again continues an interrupted tune.

  lbt tune                                             the default grid (conf/tune/default.yaml)
  lbt tune recipe=baseline,lamb dist.world_size=16,64  a grid of your own (Hydra sweep syntax)
  lbt tune tune.trials=16 tune.seeds=5 tune.dir=runs/tune/mine model=mlp trainer.epochs=5
  lbt tune tune.trials=5 tune.studies=3 tune.sampler=qmc tune.pruner=none   AlgoPerf's protocol (bench/fair.py)

tune.* keys: trials, studies (independent searches of a cell: AlgoPerf's studies), sampler (tpe|qmc:
quasi-random), objective (final | steps_to_target, with target: the val value to reach), seeds, seed,
startup_trials, pruner (median|halving|hyperband|none),
prune_startup_trials, prune_after, dir, grid, metric (acc: maximise val accuracy; loss: minimise
val loss), storage (sqlite | journal | a database URL; unset: $LBT_TUNE_STORAGE or sqlite), workers
(processes running trials at once), heartbeat (seconds). A recipe's search space is its `tune.space`
(recipes/*.yaml). Many machines: docs/tuning.md, "Tuning on a cluster".
"""


def tune_command(args: list[str]) -> None:
    """`lbt tune [overrides]`: a mistake is one `lbt: error:` line."""
    if any(arg in ("-h", "--help") for arg in args):
        print(HELP)
        return
    try:
        import optuna  # noqa: F401  (checked here: the rest of lbt runs without it)
    except ImportError:
        fail("lbt tune needs Optuna: pip install 'lbt[tune]'")
    from lbt.apps.tune.command import tune

    try:
        tune(args)
    except ConfigError as error:
        fail(str(error))
