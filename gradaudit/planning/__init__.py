"""Plan activation checkpointing to a memory budget: which modules to recompute in backward
instead of holding what their ops save, for the least extra compute.

    plan = gradaudit.plan(model, inputs, budget="8GiB", trainable=["model.layers.40.*"])
    plan.held_bytes, plan.extra_flops, plan.checkpointed
    with plan.apply(model):
        model(**inputs).loss.backward()

    plan = gradaudit.plan(model, inputs, budget="8GiB", cost="time")  # on a real device: measured time
    plan.extra_seconds, plan.step_seconds

How it works (``planner.py`` runs the steps in this order): one audit of the model (any device,
meta included) watching the candidate blocks (candidates.py) records every storage autograd holds,
which block's ops hold it, and the storages each block is passed (chain.py builds the chain from
it); one more forward and backward under ``torch.utils.flop_counter.FlopCounterMode`` gives each
block's forward FLOPs (what recomputing it costs) and a whole step's (costs.py). With
``cost="time"`` the cost the solver minimises is instead each block's forward time, measured on the
model's device (timing.py), and the FLOP figures are still reported. ``solve`` (solve.py) turns
that into the memory/compute frontier (frontier.py); the plan (result.py) is its cheapest point
within the budget, beside what a user would otherwise pick (baselines.py, segments.py), with the
peak of its step measured (peaks.py). ``Plan.apply`` checkpoints the chosen modules (apply.py).

On top of ``gradaudit.trim`` (``trim=True``, or a model trimmed already): the same audit (trim stands
aside while gradaudit audits) says what trim does to each save, since trim decides from the op
knowledge the verdicts come from: a save it drops holds nothing, a save it bit-packs holds a packed
copy of its view, and a storage another save keeps whole costs its whole size (chain.py). The
figures are then what the model holds with trim and the plan, as an audit of the planned, trimmed
model states (``saved_bytes - reclaimable_with_bitpacking_bytes``) and the storage tracker measures.
"""

from . import segments, timing  # noqa: F401  (planning.timing.REPEATS, planning.segments: as before the split)
from .apply import PlanHandle
from .candidates import repeated_blocks
from .planner import plan
from .baselines import Baseline  # noqa: F401
from .result import HELD_BOUND, PEAK_BOUND, PLAN_SCHEMA_VERSION, BudgetError, Plan  # noqa: F401

__all__ = ["plan", "Plan", "PlanHandle", "BudgetError", "Baseline", "repeated_blocks"]
