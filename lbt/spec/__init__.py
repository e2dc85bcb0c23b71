"""The lowest layer: a run's typed spec, its batch arithmetic, its LR, and the result.json schema.

Everything above reads these: `build_spec` checks a composed config once (lbt/spec/run.py),
`batch_layout` and `make_budget` do the batch arithmetic (lbt/spec/batching.py), `lr_at` is the LR
(lbt/spec/lr.py), and `RunResult` with `write_result` / `read_result` is result.json (lbt/spec/result.py).
"""

from lbt.spec.batching import BatchLayout, Budget, batch_layout, make_budget
from lbt.spec.lr import ScheduleSpec
from lbt.spec.result import EvalPoint, ResultError, RunResult, read_result, write_result
from lbt.spec.run import DistSpec, Launch, RunSpec, Target, TrainerSpec, build_spec

__all__ = ["BatchLayout", "Budget", "DistSpec", "EvalPoint", "Launch", "ResultError", "RunResult", "RunSpec",
           "ScheduleSpec", "Target", "TrainerSpec", "batch_layout", "build_spec", "make_budget", "read_result",
           "write_result"]
