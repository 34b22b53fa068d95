"""The planner's solving wing: no model runs here, only the problem a profile was turned into.

In data-flow order: ``problem.py`` states the problem and prices a choice (Rules S1, S3, S4 and
S9); ``fronts.py`` and ``options.py`` give each region its options (Rules S5, S7 and S8);
``solver.py`` chooses across regions (Rules S5 and S9); ``offload_choice.py`` what to offload
(Rule S2); ``peak.py`` predicts a plan's peak (Rule S6). A new objective, a new kind of option
or a better knapsack belongs here; measuring belongs to ``measure``, installing to ``apply``.

NOTE [Planner solve]
  Rule S1. What a choice keeps: the storages saved outside every region, plus per region either what
           autograd saves in it (not checkpointed) or its inputs, its RNG states and its saved ops'
           outputs (checkpointed, Rule A3), and its random ops' outputs if it keeps its draws (Rule
           S7). The exact count is their union; the solver's knapsack uses the sum per region, an
           upper bound (a storage kept by two regions counts twice, except what several checkpointed
           regions keep, charged once up front), and every answer is checked, and finished, against
           the exact union. A region joined to the one before it (Rule S9) keeps its inputs but
           those that one returned, and the chain's RNG state where it keeps one (Rule S9).
  Rule S2. Offload (``host_budget``, accelerators only) replaces recompute of an op output where
           moving it to host and back (at ``_HOST_BYTES_PER_SECOND`` each way) is predicted cheaper
           than re-running the op, best gain per host byte first, within the host budget; it does
           not change the device bytes the solver chose.
  Rule S3. A selective policy is not free: in a region that keeps some outputs or skips some ops
           (Rule S8), every op of the forward goes through its dispatch mode (asked per call: the
           decision depends on the occurrence, Rule M3) and every recomputed op through its replay
           mode. The solver charges the cost model's ``policy_seconds_per_op`` for it, half per op
           of the forward, half per op the replay runs (up to the early stop, Rule M9), per call, so
           a region whose kept outputs save less than they cost is checkpointed whole (Rule A1), and
           a few whole blocks can beat many partly saved ones. It is a constant of the device class,
           not a measurement of the model's regions: the modes run in Python on the host, whatever
           the device; on an accelerator that work may partly overlap device work, so the charge
           errs towards whole regions.
  Rule S4. Objective. The solver minimizes ``seconds weight x predicted recompute seconds + FLOP
           weight x recomputed FLOPs`` (plus the frame's charge, Rule M12). FLOPs are matrix work
           (``flops.op_flops``: torch's counter plus the CPU attention kernel and the few matrix ops
           it misses; elementwise ops count 0, as for the compiler's partitioner). ``"time"``: a
           second weighs 1, and recomputing all of the regions' FLOPs weighs 1 % of their predicted
           time (``_TIE_SHARE``): plans the cost model can barely tell apart are decided by FLOPs,
           as the compiler counts them. ``"flops"``: a FLOP weighs 1 and all the seconds any plan
           could recompute weigh less than half a FLOP: the fewest FLOPs, then the least time. Exact
           ties left go to the solver's first optimum, in a fixed order: equal inputs give equal
           plans.
  Rule S5. Solving. A region's options (plain; checkpointed keeping a set of its units) come from a
           0/1 knapsack over its units solved by dynamic programming over bytes, one per distinct
           (unit sizes, unit costs): identical blocks (Rule M8) share one. Where the replay may skip
           ops (Rule S8), a unit's value in the knapsack is its own cost plus that of the skippable
           ops that compute only because of it (with nothing else kept: those it alone needs); units
           that free one another (a residual sum, the dropout ``mul`` before it, the projection
           before that) form one group of which the knapsack takes one antichain, so what they free
           is not counted twice; and every set the knapsack proposes is then settled (kept units the
           replay would skip anyway are dropped: bytes for nothing) and priced exactly by the
           closure, with and without the draws, before the Pareto filter: each option's cost, and so
           the plan's prediction, is exact; only which sets are proposed is a heuristic. The
           regions' multiple-choice knapsack is a dynamic program over a byte grid: the greatest
           common divisor of the options' bytes where that gives at most ``_GRID_POINTS`` steps (the
           additive optimum, "exact"), else that many equal steps, each option's bytes rounded up
           ("grid": it fits, and costs no more than the additive optimum one step per region below
           the budget). Rounded up alone, a choice whose exact bytes sit at the budget reads as over
           it: a hand policy's, measured at its own bytes (W2's "every 2 layers": blocks whole and
           kept, each option a few hundred bytes off the grid), was missed and the plan predicted
           slower than it. So on a grid the program also runs with every option's bytes rounded
           down (a relaxation: its optimum at the budget's step costs no more than any choice that
           fits), and its answers at the budget's step and at each of the steps below, one per
           region (the lowest fits by construction), are counted exactly; the cheapest that fits,
           finished as the first, replaces the first where it costs strictly less. So a grid answer
           costs no more than before, and equals the additive optimum wherever the relaxation's
           answer fits. No greedy fallback: the exact programs solve Llama-sized models in well
           under a second, every span variant included (``benchmarks/planner.py --solve-time``).
  Rule S6. Peak. The profile measures one plain step's peak (CPU: the bytes of the storages its ops
           make, while they live, plus the work buffers of the kernels ``scratch`` knows, NOTE [Live
           bytes]; never a profiler session, which would crash beside another thread's and end a
           caller's; CUDA: ``max_memory_allocated``) and, per region, the most bytes live while its
           backward ran. A region's working set is what the regions before it keep, everything it
           saves (recompute restores it) and keeps, and the gradients of the parameters of the
           regions after it; a plan's peak is the highest, over the regions, of its working set plus
           what the plain step held there beyond its own (the gradient flowing in, the backward's
           temporaries, the kernels' buffers), or the forward's end (what the plan keeps plus the
           plain step's extra over its highest working set), whichever is higher. Where a region's
           backward was not measured (CUDA), that whole extra stands in for its own: over, never
           under.
  Rule S7. Random draws as a group. A checkpointed region may keep the outputs of all of its random
           ops (``RegionDecision.keep_draws``), all or none: recompute restores the RNG state and
           replays the draws in order, so keeping some would shift the later ones (NOTE [Selective
           checkpoint cache], Rule 10); with all kept it draws nothing. Selective checkpointing
           recomputes random ops whatever its policy says, so the keeping is the planner's own pair
           of modes (``draws``), entered below the selective ones: its forward mode keeps each
           draw's outputs (an in-place draw's values as a copy, since dropout's mask is scaled in
           place after it is drawn), its recompute mode answers the random ops from them, in order,
           once. The group costs the bytes of the random ops' storages (all of the region's, those
           after the early stop too: the mode cannot see the stop) and saves their seconds and FLOPs
           up to the early stop (attention with dropout where it is one op, as on CUDA: its matrix
           work; on CPU the draws are ``bernoulli_`` calls, time without FLOPs). Its modes are
           charged the selective policy's cost (Rule S3), on top of the selective modes' where the
           region also keeps outputs or skips ops (two pairs of Python modes; the draws ones do less
           per op: over, never under). The RNG states are still captured and counted (Rule A3):
           over, never under. It is not offered where an out-of-place draw's output is written in
           place later in the region (the kept tensor must be unchanged; the recompute mode checks
           its version) or where a draw writes a region input.
  Rule S8. Skipping in replay. Recompute serves only what autograd saves in the region, so an op
           none of whose outputs' values anything needs need not run: the plan answers it
           ``SKIP_IN_REPLAY`` (``RegionDecision.skip``) and the replay hands out blanks of its
           outputs' metadata (NOTE [Selective checkpoint cache], Rule 14). Which ops compute is a
           closure over the ops up to the early stop (Rule M9), on storage ids (a view shares its
           base's, Rule M4). Roots: in-place ops (Rule M5), ops without a tensor output or whose
           outputs blanks cannot stand for, random ops (Rule M6) unless the region keeps its draws
           (then they are answered from the forward and need nothing, Rule S7), and the producers of
           the storages autograd saves that the region does not keep. An op computes if it is a root
           or writes a needed storage; a storage is needed if autograd saves it or a computing op
           reads its values (the ``*_like`` and ``new_*`` factories read only metadata, as the
           replay's taint counts them); kept units run not and need nothing; views always run, on
           blanks too, and need nothing. A skippable op (a unit whose every output is a plain dense
           tensor in a storage of its own, as the replay's mode decides; no effect op) that does not
           compute costs nothing; every other op not kept costs its seconds and FLOPs. A region that
           keeps nothing but skips something pays the selective policy (Rule S3); keeping nothing
           without a policy stays an option, with or without the draws (Rule S7). In a decoder block
           with dropout the down projection (its output feeds only dropout's ``mul``, which saves
           the mask) is skipped with nothing kept; keeping the residual sum after attention skips
           the attention's output projection and its dropout's ``mul`` too (torch.compile's
           partitioner does not run them either). The profile records per op the activation storages
           it reads and whether it may be skipped; the solver gets each region's replay as plain
           data (``ReplayGraph``, its storages numbered within the region, so identical blocks give
           equal graphs and are solved once, Rule S5). The replay's taint refuses a blank that
           reaches a saved tensor: a wrong plan raises, never gives a wrong gradient.
  Rule S9. Chains. Several consecutive regions may be checkpointed in one frame, as the segments of
           ``checkpoint_sequential`` are (``Choice.joined``, ``RegionDecision.joined``: "with the
           region before it"): each member after the first is whole (nothing kept, no mode of the
           planner's) and follows a whole or joined one. The chain keeps its first member's inputs,
           what a later member receives that is not its predecessor's output (a mask, a rotary
           table), and one RNG state (always: the runtime preserves it); the boundaries, each
           member's output passed to the next, are kept nowhere and recomputed. Counted: a joined
           region keeps its inputs less ``boundary`` (those the region before it returned); and the
           RNG states a frame entered at it captures (``states``, whether it draws or not) where the
           region before it drew nothing, none where it drew. The chain keeps the states its first
           member captured, drawing or not (the runtime preserves them always); the first member
           keeps them itself where it draws, else the second, whose captured CPU state is the
           first's (Rule A3: no draw between, one state); a drawing member keeps the chain's. A
           member after a non-drawing one after a drawing one counts a state the run does not keep,
           and so does each device state (one a capture): over, never under. Priced: the member
           before a joined region recomputes past its early stop (Rule M9: its output is the next
           one's input), so a joined region pays that one's ``rest_seconds``, FLOPs and frame charge
           (Rule M12) beside its own whole recompute. Joinable (``measure``, the profiled step):
           each ran once, the later right after the earlier on the same thread outside every other
           region, no op dispatched between them; what the later received that the earlier made is
           the earlier's output; neither keeps anything whatever it saves (collectives, kept spans:
           Rules M14 and M15) nor is planned without recompute; and neither ends at a trail (Rule
           M13: its frame ends before its own end). Otherwise the runtime would break the chain
           there, so the plan never counts on it. Solved (Rule S5) with two states per byte step,
           the last region counted whole or joined (the next may join) or not; the exact finish
           moves no member of a chain. At equal cost a join loses (its row weighs ``_JOIN_TIE`` of
           its cost more): its bytes are taken only where the budget needs them, since a chain's
           recompute holds more at once (below); the prediction, ``recompute_cost``, is exact. Peak
           (Rule S6): the chain's one recompute restores every member's saved tensors at once, so
           while backward runs a member the members before it hold theirs. The floor
           (``floor_bytes``, and ``solve``'s answer below it) counts on joins: the fewer bytes of
           two walks, from each region's fewest-bytes option joining where that keeps fewer, and
           from every join the regions allow parting where that keeps fewer (``_lowest_rows``).
           Both: a chain keeps one RNG state however long, so on draw-free blocks one join keeps
           more than it drops and a long chain less. A walk, not a search: on some problems
           (found by the brute-force test) a choice keeps fewer still; the floor is then above
           the fewest bytes, never below what the answer keeps.
"""
