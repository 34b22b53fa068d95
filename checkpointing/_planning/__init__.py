"""Memory-budget planning in eager mode: measure a step, solve, apply the plan.

Three wings, in data-flow order, under one front door:

- ``search.py``: the front door, ``plan_checkpointing``: the arguments, the regions, the budget
  against the floor, the span variants, the cheapest plan that fits, the timed race (opt-in).
- ``sweep.py``: ``plan_sweep``, the plans of several budgets from one profile, and the promise a
  sweep keeps. NOTE [Budget sweep].
- ``first_step.py``: a second door beside it, for callers without example inputs
  (``apply_spec``'s budget key, torchtitan's ``MemoryBudgetAC``): plan at a model's first
  forward under grad. NOTE [Budget at the first step].
- ``measure/``: running the model and turning what it saw into a problem: the profile, the
  recorder and what it watches, the cost model, the recorded spans, timing candidate plans.
  A model family's quirk goes here. NOTE [Planner measure], Rules M1-M15.
- ``solve/``: no model runs here: the problem's terms and prices, each region's options, the
  solver, what to offload, the predicted peak. A new objective goes here. NOTE [Planner solve],
  Rules S1-S8.
- ``apply/``: the plan object and its JSON, installing it on a model and taking it off, a planned
  region's contexts, the spans' hooks and the draw guard at run time. NOTE [Planner apply],
  Rules A1-A3.

``solve`` imports neither other wing; ``measure`` imports ``solve``'s problem (it builds one);
``apply`` imports both (a plan is made of a profile and a solution); none imports ``search``
(``sweep`` does: a second front door above it; both check their arguments with
``arguments``). Each wing's ``__init__`` holds its NOTE and imports nothing. Rules are cited by
label everywhere ("Rule S5", "NOTE [Planner solve], Rule S5" outside the planner);
``tests/test_house.py`` checks that every cited planner rule exists.

Glossary. *region*: a module the plan may checkpoint, one frame (a block; a tail module, Rule M10).
*unit*: an op of a region whose outputs the plan may keep. *storage*: the unit of bytes, numbered
per step (Rule M1); *outside*: kept whatever the plan; *charged*: counted once, up front (Rule S1).
*draws*: a region's random ops, kept all or none (Rule S7). *early stop*: where a region's recompute
ends (Rule M9). *replay*: what recompute runs; *skip*: an op nothing needs is not run; *useless*: a
kept unit the replay would skip anyway; *settle*: drop those and price a set exactly (Rule S8).
*front*, *options*: a region's Pareto sets of units and of choices (Rule S5). *span* (in full,
*recorded span*): a stretch a ``gradient_checkpoint_scope`` records: the *head*, the *tail*
(Rule M11), a *trail* (Rule M13); *late*: saved after the forward returned; *held*: read by a span
from outside, kept by its tape (Rule M11). *kept span*: a ``keep(fn, ...)`` call (Rule M14), never
shortened to *span* here. *floor*: the fewest bytes a plan can keep; *baseline*: the plain run's.
Measurements behind the rules are in benchmarks/RESULTS.md ("Planner model: measurements behind the
rules").

Rule index (each rule in its wing's ``__init__``):
  measure  M1 bytes are storages; M2 activations; M3 op keys; M4 views; M5 in-place groups;
           M6 random ops are recomputed; M7 profiling leaves the model as found; M8 prices are
           counted, never timed; M9 early stop; M10 the tail as regions; M11 spans around the
           blocks; M12 determinism, what a frame costs, the timed race; M13 trails; M14 kept
           spans; M15 sharded models.
  solve    S1 what a choice keeps; S2 offload; S3 a selective policy's cost; S4 the objective;
           S5 solving; S6 the peak; S7 random draws as a group; S8 skipping in replay.
  apply    A1 installing; A2 input shapes; A3 RNG states and the draw guard.
"""

from __future__ import annotations

from .apply.plan import ActivationPlan, RegionDecision, SpanDecision
from .measure.costs import DeviceCosts
from .search import plan_checkpointing
from .sweep import plan_sweep

__all__ = [
    "ActivationPlan",
    "DeviceCosts",
    "RegionDecision",
    "SpanDecision",
    "plan_checkpointing",
    "plan_sweep",
]
