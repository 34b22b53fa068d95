"""Memory-budget planning in eager mode: profile a step, solve, install.

In data-flow order: ``search.py`` is the front door (``plan_checkpointing``: arguments, regions, the
budget, the span variants, the cheapest that fits); ``plan.py`` the result (``ActivationPlan``) and
installing it, ``contexts.py`` a planned region's selective policy, ``draws.py`` its kept random
draws (Rule 19), ``installed.py`` taking a plan off a model or a copy; ``trials.py`` times candidate
plans, opt-in (Rule 23); ``profile.py`` runs the model at plan time (Rule 9), ``recorder.py``
watches the one recorded step (``flops.py`` counts an op's FLOPs, ``kept_span_watch.py`` tells a
kept span's ops and saves apart, Rule 25; ``live_bytes.py`` reads the peaks of a plain step's
memory, ``scratch.py`` the kernels' work buffers), ``step_profile.py`` holds what it saw as data in
the solver's terms, ``steps.py`` a step's loss and backward; ``costs.py`` prices ops, policies,
frames and recorded spans (Rule 9); ``recorded_spans.py`` records the head, the tail (Rule 22) and
the blocks' trails (Rule 24); ``problem.py`` states the problem and prices a choice, ``fronts.py``
and ``options.py`` give each region its options, ``solver.py`` chooses across regions,
``offload_choice.py`` what to offload (Rule 10), ``peak.py`` predicts a plan's peak;
``plan_json.py`` writes and reads plans. The rules below are shared by all of them.

Glossary. *region*: a module the plan may checkpoint, one frame (a block; a tail module, Rule 20).
*unit*: an op of a region whose outputs the plan may keep. *storage*: the unit of bytes, numbered
per step (Rule 1); *outside*: kept whatever the plan; *charged*: counted once, up front (Rule 7).
*draws*: a region's random ops, kept all or none (Rule 19). *early stop*: where a region's recompute
ends (Rule 16). *replay*: what recompute runs; *skip*: an op nothing needs is not run; *useless*: a
kept unit the replay would skip anyway; *settle*: drop those and price a set exactly (Rule 21).
*front*, *options*: a region's Pareto sets of units and of choices (Rule 17). *span* (in full,
*recorded span*): a stretch a ``gradient_checkpoint_scope`` records: the *head*, the *tail* (Rule
22), a *trail* (Rule 24); *late*: saved after the forward returned; *held*: read by a span from
outside, kept by its tape (Rule 22). *kept span*: a ``keep(fn, ...)`` call (Rule 25), never
shortened to *span* here. *floor*: the fewest bytes a plan can keep; *baseline*: the plain run's.
Measurements behind the rules are in benchmarks/RESULTS.md ("Planner model: measurements behind the
rules").

NOTE [Planner model]
  Rule 1. Bytes are storages: a tensor kept for backward costs its whole storage, once, however
          many views of it are kept and however many ops keep it (as the saved-tensor report
          counts them).
  Rule 2. Activations are the storages produced by ops during the step; the parameters, buffers
          and example inputs (and anything made before the step) are not: they stay in memory
          whatever is checkpointed. Tensors that do not require grad but are saved (dropout
          masks, attention masks made in forward) are activations: they take memory.
  Rule 3. An op inside a region is keyed by its overload and its occurrence index among that
          overload's calls in one call of the region, counting as selective checkpointing counts
          (``SAC_IGNORED_OPS`` skipped; NOTE [Selective checkpoint cache], Rule 3), so the
          policy installed by ``apply`` sees in forward the keys the profile saw, and recompute
          replays the forward's decisions.
  Rule 4. Views cost nothing: an op whose outputs share an input's storage is never saved (its
          base is) and is always re-run in recompute, where it is free.
  Rule 5. In-place groups share their producer's fate: a storage written in place inside a
          region (and the op that made it) is recomputed, never saved: a saved producer would be
          version-checked against its later writes, a saved writer would not re-apply its write
          to the recomputed base.
  Rule 6. Random ops (and everything in their in-place group, e.g. dropout's mask) are
          recomputed (NOTE [Selective checkpoint cache], Rule 10), unless the region keeps
          its draws as a group (Rule 19).
  Rule 7. What a choice keeps: the storages saved outside every region, plus per region either
          what autograd saves in it (not checkpointed) or its inputs, its RNG states and its
          saved ops' outputs (checkpointed, Rule 14), and its random ops' outputs if it keeps its
          draws (Rule 19). The exact count is their union; the
          solver's knapsack uses the sum per region, an upper bound (a storage kept by two
          regions counts twice, except what several checkpointed regions keep, charged once up
          front), and every answer is checked, and finished, against the exact union.
  Rule 8. Profiling leaves the model as found: parameters (values and ``.grad``: gradients go
          through ``torch.autograd.grad``, Rule 26), buffers (copied back where written: BatchNorm's
          statistics), CPU and CUDA RNG states (``torch.random.fork_rng``), module hooks
          (removed), and the caller's modes (the profiled steps run with grad enabled, also
          under ``no_grad`` or ``inference_mode``). ``_untouched.untouched`` is the one
          mechanism; ``checkpoint_sequential`` measures its chain under it too.
  Rule 9. Prices are counted, never timed. An op's seconds are the cost model's (``costs.py``):
          a dispatch cost, its FLOPs (``flops.op_flops``) at the device class's FLOP rate, and
          the bytes it reads and writes (its tensor arguments' elements, none for an op that
          reads only metadata, and its outputs' in storages of their own or written in place; a
          view moves none) at the class's bandwidth; summed over the region's calls. Why: the
          plan must be a function of the model, the inputs, the budget and the options (two
          calls, two ranks, one plan), and measured op times made it one of the machine's noise
          as well; the model errs alike for every plan it compares. Identical blocks get equal
          prices by construction (the same ops on the same shapes), so they pose one problem
          (Rule 17). The profile records one step (and runs one forward before it, one plain
          step after it for the peak, Rule 18): the model runs three times at plan time. The
          constants (one set per device class) are measured by ``benchmarks/planner.py
          --cost-model``; their values, machine and date are in RESULTS.md.
  Rule 10. Offload (``host_budget``, accelerators only) replaces recompute of an op output
          where moving it to host and back (at ``_HOST_BYTES_PER_SECOND`` each way) is predicted
          cheaper than re-running the op, best gain per host byte first, within the host budget;
          it does not change the device bytes the solver chose.
  Rule 11. ``apply`` installs ``checkpoint_module`` (non-reentrant; names and ``state_dict``
          keys untouched) on each checkpointed region, with a selective policy only where it
          keeps, offloads or skips something (Rule 21): a region that keeps and skips nothing
          runs as plain checkpoint.
          A region that keeps its draws gets the draws modes (Rule 19), under the selective
          ones where it keeps outputs too.
  Rule 12. Inputs whose shapes differ from the profiled ones warn once per ``apply`` ("re-plan"):
          the bytes and times describe the profiled shapes only. Calls under ``no_grad`` keep
          nothing and never warn. Positional inputs are compared in order, keyword ones by name
          (whatever order the call gives them in); 0-d tensors are left out: a scalar (a loss's
          token count, a temperature) changes its value, never its shape or the bytes kept, and
          comes and goes between calls.
  Rule 13. A selective policy is not free: in a region that keeps some outputs or skips some ops
          (Rule 21), every op of the forward goes through its dispatch mode (asked per call: the
          decision depends on the occurrence, Rule 3) and every recomputed op through its replay
          mode. The solver charges the cost model's ``policy_seconds_per_op`` for it, half per op
          of the forward, half per op the replay runs (up to the early stop, Rule 16), per call,
          so a region whose kept outputs save less than they cost is checkpointed whole (Rule
          11), and a few whole blocks can beat many partly saved ones. It is a constant of the
          device class, not a measurement of the model's regions: the modes run in Python on
          the host, whatever the device; on an accelerator that work may partly overlap device
          work, so the charge errs towards whole regions.
  Rule 14. A checkpointed region keeps what its frame keeps (NOTE [Nestable checkpoint], Rule
          11): its input activations, those received by keyword or inside a container included,
          and, if it draws, the RNG states it captures. A region draws where a call of it ran a
          random op (a kept span's included): its own ops, on the profiling thread, which the
          recorder's dispatch mode sees; never a comparison of the process's generator state,
          which another thread's draws (a data loader's, a sampler's) move too, so the plan is
          the same whatever else the program draws. A region that only sets a generator
          (``torch.manual_seed`` or ``set_rng_state`` in its forward) draws nothing: its
          gradients are right, and its recompute sets the generator again during backward, as
          torch's checkpoint without ``preserve_rng_state`` does. ``RegionDecision.draws``
          records it (unknown, from older JSON or pickles: drawing). ``apply`` preserves RNG
          state only for drawing regions: one that draws nothing keeps no state and is charged
          none, since its recompute draws nothing either. That is safe only while it really
          draws nothing, hence for planned regions only, each under a ``DrawGuard``
          (``installed.py``), which is its ``context_fn``: its hooks compare the CPU
          generator's state, and each accelerator's among the region's inputs, before and after
          each forward under grad, as bytes; where none moved the call drew nothing (but inside
          ``torch.random.fork_rng``, which moves nothing: the profile sees such draws all the
          same, so only a model that starts drawing after planning can do that); where one
          moved, by the call's draws or another thread's, the call's recompute runs under an
          alarm (``draws.guarded_replay``) that raises ``CheckpointError`` at the first random
          op the recompute runs, before it draws: a model planned in eval mode and trained in
          train mode. The recompute's own ops decide, so another thread's draws raise nothing,
          and a draw the recompute never runs (after the early stop, Rule 16) harms nothing and
          raises nothing. What the guard holds per thread is a ``threading.local``, gone with
          the thread. Why not a dispatch mode in every forward: it would check every op of
          every call; the hooks read two generator states per call, the alarm runs only where
          one moved (costs in benchmarks/RESULTS.md). Under ``torch.compile`` the guard stands
          aside: torch's region gets the region's own contexts, and its partitioner keeps random
          ops' outputs. Under the debug report (``set_checkpoint_debug_enabled``), whose op loggers
          are a checkpoint's contexts, the guard stands in as the region's own contexts
          (``stand_in``) and its hooks check the forward itself: a moved generator raises there
          (another thread's draws too, while debugging). Profiling captures the states at each call
          as the frame does (``ForwardState``) and keeps only the drawing regions' ones; a CPU
          capture with no random op of the step since the previous capture is that capture's
          storage, kept if any drawing region sharing it is checkpointed: the frame shares a state
          identical to its previous capture, and draws only move the stream on. The real run
          captures fewer states than the profile (draw-free and unplanned regions capture none), so
          it shares at least where the profile does, unless another thread draws between two drawing
          regions' calls: the frame then shares less (one CPU state more per such call: under by
          that, the one place where the count is not over). (A region that moves the stream back,
          e.g. by reseeding, is counted apart where the frame would share: over, never under.)
          Device states (one per accelerator tensor among the positional inputs) are never
          shared.

  Rule 15. Objective. The solver minimizes ``seconds weight x predicted recompute seconds +
          FLOP weight x recomputed FLOPs`` (plus the frame's charge, Rule 23). FLOPs are matrix
          work (``flops.op_flops``: torch's counter plus the CPU attention kernel and the few
          matrix ops it misses; elementwise ops count 0, as for the compiler's partitioner).
          ``"time"``: a second weighs 1, and recomputing all of the regions' FLOPs weighs 1 % of
          their predicted time (``_TIE_SHARE``): plans the cost model can barely tell apart are
          decided by FLOPs, as the compiler counts them. ``"flops"``: a FLOP weighs 1 and all the
          seconds any plan could recompute weigh less than half a FLOP: the fewest FLOPs, then
          the least time. Exact ties left go to the solver's first optimum, in a fixed order:
          equal inputs give equal plans.
  Rule 16. Early stop. A checkpoint's frame has a holder for every tensor autograd saves in
          the region (parameters included) and its recompute stops once the last is filled
          (NOTE [Nestable checkpoint]); an op's inputs are saved before it runs, its outputs
          after. The profile notes, per region call, how many ops had run when the last save
          happened; the ops after that cost nothing to recompute and keeping their outputs
          saves nothing, so they are neither charged nor offered (a Llama block's down
          projection: its input is the last save). Before the stop, the replay may skip the
          ops whose outputs nothing needs (Rule 21).
  Rule 17. Solving. A region's options (plain; checkpointed keeping a set of its units) come
          from a 0/1 knapsack over its units solved by dynamic programming over bytes, one per
          distinct (unit sizes, unit costs): identical blocks (Rule 9) share one. Where the
          replay may skip ops (Rule 21), a unit's value in the knapsack is its own cost plus
          that of the skippable ops that compute only because of it (with nothing else kept:
          those it alone needs); units that free one another (a residual sum, the dropout
          ``mul`` before it, the projection before that) form one group of which the knapsack
          takes one antichain, so what they free is not counted twice; and every set the
          knapsack proposes is then settled (kept units the replay would skip anyway are
          dropped: bytes for nothing) and priced exactly by the closure, with and without the
          draws, before the Pareto filter: each option's cost, and so the plan's prediction, is
          exact; only which sets are proposed is a heuristic. The regions' multiple-choice
          knapsack is a dynamic program over a byte grid: the greatest common divisor of the
          options' bytes where that gives at most ``_GRID_POINTS`` steps (the additive optimum,
          "exact"), else that many equal steps, each option's bytes rounded up ("grid": it fits,
          and costs no more than the additive optimum one step per region below the budget). No
          greedy fallback: the exact programs solve Llama-sized models in well under a second,
          every span variant included (``benchmarks/planner.py --solve-time``).
  Rule 18. Peak. The profile measures one plain step's peak (CPU: the bytes of the storages its
          ops make, while they live, plus the work buffers of the kernels ``scratch`` knows,
          NOTE [Live bytes]; never a profiler session, which would crash beside another
          thread's and end a caller's; CUDA: ``max_memory_allocated``) and, per region, the
          most bytes live while its backward ran. A region's working set is what the regions
          before it keep, everything it saves (recompute restores it) and keeps, and the
          gradients of the parameters of the regions after it; a plan's peak is the highest,
          over the regions, of its working set plus what the plain step held there beyond its
          own (the gradient flowing in, the backward's temporaries, the kernels' buffers), or
          the forward's end (what the plan keeps plus the plain step's extra over its highest
          working set), whichever is higher. Where a region's backward was not measured (CUDA),
          that whole extra stands in for its own: over, never under.
  Rule 19. Random draws as a group. A checkpointed region may keep the outputs of all of its
          random ops (``RegionDecision.keep_draws``), all or none: recompute restores the RNG
          state and replays the draws in order, so keeping some would shift the later ones
          (NOTE [Selective checkpoint cache], Rule 10); with all kept it draws nothing.
          Selective checkpointing recomputes random ops whatever its policy says, so the
          keeping is the planner's own pair of modes (``draws``), entered below the selective
          ones: its forward mode keeps each draw's outputs (an in-place draw's values as a
          copy, since dropout's mask is scaled in place after it is drawn), its recompute mode
          answers the random ops from them, in order, once. The group costs the bytes of the
          random ops' storages (all of the region's, those after the early stop too: the mode
          cannot see the stop) and saves their seconds and FLOPs up to the early stop
          (attention with dropout where it is one op, as on CUDA: its matrix work; on CPU the
          draws are ``bernoulli_`` calls, time without FLOPs). Its modes are charged the
          selective policy's cost (Rule 13), on top of the selective modes' where the region
          also keeps outputs or skips ops (two pairs of Python modes; the draws ones do less
          per op: over, never under). The RNG
          states are still captured and counted (Rule 14): over, never under. It is not
          offered where an out-of-place draw's output is written in place later in the region
          (the kept tensor must be unchanged; the recompute mode checks its version) or where
          a draw writes a region input.
  Rule 20. The tail as regions. By default (``regions=None``) the modules the model calls
          after its last block (every call of one starting after the blocks' last call ended:
          a Llama's final norm and LM head) are regions too, outermost ones, found by one
          forward before profiling; the solver checkpoints them or not like the blocks, or
          records them whole (Rule 22). Work after the tail's last module (a loss computed in
          the model's own ``forward``, as Hugging Face models do) stays outside every region.
  Rule 21. Skipping in replay. Recompute serves only what autograd saves in the region, so an
          op none of whose outputs' values anything needs need not run: the plan answers it
          ``SKIP_IN_REPLAY`` (``RegionDecision.skip``) and the replay hands out blanks of its
          outputs' metadata (NOTE [Selective checkpoint cache], Rule 14). Which ops compute is
          a closure over the ops up to the early stop (Rule 16), on storage ids (a view shares
          its base's, Rule 4). Roots: in-place ops (Rule 5), ops without a tensor output or
          whose outputs blanks cannot stand for, random ops (Rule 6) unless the region keeps
          its draws (then they are answered from the forward and need nothing, Rule 19), and
          the producers of the storages autograd saves that the region does not keep. An op
          computes if it is a root or writes a needed storage; a storage is needed if autograd
          saves it or a computing op reads its values (the ``*_like`` and ``new_*`` factories
          read only metadata, as the replay's taint counts them); kept units run not and need
          nothing; views always run, on blanks too, and need nothing. A skippable op (a unit
          whose every output is a plain dense tensor in a storage of its own, as the replay's
          mode decides; no effect op) that does not compute costs nothing; every other op not
          kept costs its seconds and FLOPs. A region that keeps nothing but skips something
          pays the selective policy (Rule 13); keeping nothing without a policy stays an
          option, with or without the draws (Rule 19). In a decoder block with dropout the
          down projection (its output feeds only dropout's ``mul``, which saves the mask) is
          skipped with nothing kept; keeping the residual sum after attention skips the
          attention's output projection and its dropout's ``mul`` too (torch.compile's
          partitioner does not run them either). The profile records per op the activation
          storages it reads and whether it may be
          skipped; the solver gets each region's replay as plain data (``ReplayGraph``, its
          storages numbered within the region, so identical blocks give equal graphs and are
          solved once, Rule 17). The replay's taint refuses a blank that reaches a saved
          tensor: a wrong plan raises, never gives a wrong gradient.
  Rule 22. Spans around the blocks. Module frames keep their inputs, so a model of N blocks
          keeps N + 1 residual-stream tensors at their boundaries (the first block's input, the
          tail's) where torch.compile's partitioner keeps N (it recomputes the embedding and the
          final norm from what it keeps). By default the plan may record two spans with a
          ``gradient_checkpoint_scope`` (``recorded_spans.py``): the head, from the model's
          start to its first block's (the embedding, rotary angles), and the tail, from its first
          tail
          module's start to its last one's end (Rule 20). Every storage a recorded span makes is
          kept nowhere: whoever saves it (a block's frame as its positional input, a plain
          region, an op outside the regions) gets a holder, and backward replays only the ops
          that make what it unpacks (NOTE [Gradient checkpoint scope], Rules 2 and 7); the
          activations it reads from outside (the last block's output) are kept by its tape; a
          frame's keyword or nested inputs are kept by plain reference all the same; the tail's
          modules run plainly inside it. A session opened at the model's start and closed at its
          end keeps our saved-tensors hook on the stack whatever the caller pushed (a report,
          ``save_on_cpu``): the head's tensors are saved after its scope closed (Rule 4 there).
          At the model's end the spans give up their claims on that hook, so none of ours stays
          on the caller's stack after the step; a span's tensor saved after the model's forward
          returned (by a loss computed outside it) is kept, and the profile counts it so. A
          model call under ``no_grad``, in a recompute or inside a checkpoint's frame (the whole
          planned model checkpointed again) records no span: that frame must see every save, in
          forward and in recompute alike. A recorded span pays its replay and its recording: per
          op, priced as the selective modes, and per call the cost model's
          ``span_call_seconds``, what a scope and its session cost beyond that (without it a
          trail's machinery went unpriced, Rule 24). The solver solves the step with each subset
          of the spans recorded (at most four problems) and takes the cheapest that fits; the
          floor is the lowest. A span is not offered where it draws random numbers (its tape
          would keep an RNG state per draw, uncounted), writes in place a tensor it did not make
          (an argument the op's schema marks as written, or batch norm's running statistics in
          training, which it does not mark, as the scope's tape counts them: a parameter, a
          buffer, an earlier activation), or frees nothing; nor with a ``regions`` predicate.
          Why: that one boundary per model is what stood between the plans and the compiler's
          FLOPs.
  Rule 23. Determinism, and what a frame costs. A checkpointed region costs more than its ops'
          recompute (its frame, the holders, the recompute's graph): the solver charges the cost
          model's ``frame_seconds_per_op`` per op its replay runs, per call
          (``RegionChoices.frame_seconds``), in the cost it minimizes, never in the predicted
          seconds (those are the ops' own, Rule 9). With counted prices (Rules 9, 13, 22) a plan
          is a function of the model (its structure, shapes and dtypes; where ops depend on
          values, such as a router's, the values), the example inputs, the budget, the options
          and the device class's constants: two calls give one plan, and so do the ranks of a
          job given the same inputs, with no collective (a rank may plan alone). Timing is
          opt-in (``timing_steps > 0``; the default 0 times nothing): the solver then also solves
          with the two least sure prices moved (``search._PERTURBED``: the policy's halved and
          doubled, the frame's dropped, and doubled with the policy's halved), every plan priced
          by the model whatever drew it; where that gives more than one distinct plan, each is
          applied and timed on the model (``trials.py``): every plan once a round, the order
          turned, a warm-up round first, the garbage collector off (its youngest generation
          collected between rounds), each step divided by its round's mean; a plan leaves once
          the one of least median so far beat it in so many rounds that a coin would have done
          it with a chance below 1 % (a sign test: seven rounds at the least); the rounds end
          when one is left, or after ``timing_steps``. The fastest is returned with the timings
          (``ActivationPlan.timed``). Measured times differ between ranks, so where a default
          process group is initialized every rank returns rank 0's choice (its JSON broadcast;
          every rank must call). Why opt-in: the race cost up to six candidates times 7-24
          rounds of steps (a small GPT planned in 224 s by default, 29 s without it) for a gain
          measured at 2-3 % on CPU, and it made the plan a function of the machine's load. The
          model, ``.grad`` and the RNG states are left as found (Rule 8); no plan stays applied,
          whatever a step raises.
  Rule 24. Trails. A post-norm block ends by calling its final norm on a residual sum (``norm2(h
          + ff)``), and the next block's frame keeps the norm's output as its input; a plan that
          keeps the sum, to skip the matmul behind it, kept that boundary twice, where
          torch.compile's partitioner keeps the sum and remakes the norm. The profile notes per
          block (blocks only, one call per step) the child module it calls last: once, with no
          op after it, its output the block's; and what the block had saved, and its early stop
          (Rule 16), when the child started (``profile.Trail``). The plan may record every
          block's such child as a trail, all of them or none (beside the head and tail subsets:
          at most eight problems): the block's region ends where the child starts (``end_at``:
          its frame ends in the child's pre-hook, and its recompute there too, by early stop or,
          where early stop is off, by that hook; NOTE [Module checkpoint hooks], Rule 7), and a
          ``gradient_checkpoint_scope`` records the child as a span (Rule 22): what it makes
          (the next block's input, the norm's statistics) is kept nowhere, what it reads (the
          sum) is kept by its tape, its replay and its recording are paid. The region's problem
          is the profile cut at the child: its ops, saves and early stop as they were then. A
          trail none of whose storages anyone else keeps (the last block's, whose output only
          the loss reads) is left out; so is one that draws random numbers or writes what it did
          not make (Rule 22's conditions). Pre-norm blocks (a Llama's, GPT-2's, a ViT's) end in
          a residual add, not a child call: no trail. Why: the boundary kept twice is what kept
          post-norm plans above the compiler's FLOPs at its bytes. Where the race runs
          (``timing_steps > 0``, Rule 23), the cheapest plan without trails is one more
          candidate of it when the prediction chose trails: their machinery is priced per call
          (Rule 22) by a constant, and a timed step is where such a constant's error shows.
          Under ``torch.compile`` the blocks are torch's regions, whole: the end hook returns at
          once while dynamo traces.
  Rule 25. Kept spans. In a checkpointed region the ops of a ``keep(fn, *args)`` span are
          neither counted nor cached by the selective modes, nor replayed (NOTE [Kept spans],
          Rule 6): they are the span's, not the policy's. The profile runs the model without
          checkpointing, where ``keep`` would be a plain call, so its pack hook
          (``kept_span_watch.SpanWatch``) asks ``keep`` for the span (NOTE [Kept spans], Rule
          11) and runs it under the span's marker: the ops inside are not the region's (not
          numbered, so
          they shift no key of Rule 3; not priced nor offered, nor in the replay graph or the
          draws), and what reads the span's outputs reads a storage the replay is served. A
          save inside the span that is one of its arguments or a view of one is a holder, as
          the frame makes it (the argument's producer is needed, Rule 21; the early stop moves,
          Rule 16); any other is kept by the span and is the region's whenever it is
          checkpointed (``RegionProfile.kept``, charged with its inputs), as are the span's
          outputs that are no view of an argument once a holder is made at or after the span's
          start (early stop releases the others). Un-checkpointed, the span is a plain call and
          the region keeps what autograd saves, the span's saves included. Rule 19's draws modes
          pass a span's ops by as the selective ones do, so a region that keeps its draws keeps
          its spans too. Why the watch and not the profile under checkpoint: what autograd saves
          would hide behind the frame's holders (see Rejected); why in the pack hook: ``keep``
          decides by the top saved-tensors hook (Rule 1 there), and a hook of the user's or a
          span inside a span makes it a plain call in the profile as at run time. A region that
          runs a ``with keeping():`` block is planned without recompute
          (``RegionProfile.kept_blocks``; plain-only, as a tail module recorded in a span is,
          Rule 22): in the profile a block is a plain call, its ops numbered there and not at
          run time (so a policy's keys would name other ops), and what it keeps is everything
          it saves while its replay runs it again; run plainly, the region keeps what autograd
          saves, which the profile counts exactly. Why not modelled as a span: the watch learns
          where a block starts, never where it ends. Not modelled: a span's RNG states, a
          span's host copies (offload policies, counted as kept) and early stop turned off
          (every span's outputs are then held).
  Rule 26. Sharded models. Parameters are never activations, sharded or gathered: a
          ``DTensor``'s memory is its local shard's (NOTE [Storage keys], Rule 3), so the
          shards of FSDP2 and of tensor parallelism are leaves (Rule 2) like any parameter;
          FSDP2's unsharded parameters are made during the forward by its own ops (``fsdp::``,
          and ``c10d::`` collectives in place on its buffers), at addresses an earlier
          activation may have had, so what those ops make or fill loses any id it had and the
          ops are not the region's (the recorder passes them by; they are the sharding's, not
          the plan's). Functional collectives (``_c10d_functional::``, tensor parallelism's;
          ``_selective``'s ``is_collective``) make activations and are kept, never re-run: a
          checkpointed region that runs one keeps its outputs (in ``RegionProfile.kept``,
          charged with its inputs, as a kept span's saves are, Rule 25) and its plan lists its
          collectives among what it saves (``RegionDecision.save``), so ``apply`` gives it a
          selective policy (Rule 11), under which the collective rule keeps them (NOTE
          [Collectives under selective checkpointing]); a plain checkpoint would run them again
          in backward (a second round of communication, and ranks out of step where their
          recomputes differ). The recorder gives such an op no price and no unit: in the replay
          it runs not and needs nothing (a view's role, Rule 21), so what only it reads may be
          skipped. The region's options that keep and skip nothing else are priced without the
          selective modes' charge (Rule 13) that its collectives' policy adds: under by that
          charge, a price, never bytes.
          A measured step differentiates with ``autograd.grad`` with respect to every leaf its
          graph reaches, FSDP2's gathered parameters included: the whole backward runs, so
          FSDP2's hooks run and reshard as after a real step, and no ``.grad`` is written, so
          there is nothing for them to reduce into the sharded gradients (a backward that
          accumulated, its ``.grad`` put back after, left the root's gathered parameters'
          reductions in the sharded gradients and added in place to a gradient already there).
          A ``DistributedDataParallel`` runs the profile under its ``no_sync()`` (``untouched``),
          so its reducer counts no iteration; one with ``static_graph=True`` that has not run its
          first step is refused (that step's backward records the graph). Every rank profiles
          its own share: FSDP2's rank plans its own rows, a tensor-parallel rank its own shard
          of the split activations.

Rejected: profiling under checkpoint with a save-everything policy (what autograd saves is then
hidden behind the frame's holders); timing whole steps with every region checkpointed, plainly
and under the policy, to price the policy (the difference is a few percent of a step, below the
step-to-step noise of a few steps on a shared machine; Rule 23 times whole plans against each
other instead, round by round, only where the prices disagree); and torch's ``SACEstimator``
(private, CUDA-oriented, and it counts per tensor, not per storage).
"""

from __future__ import annotations

from .plan import ActivationPlan, RegionDecision, SpanDecision
from .search import plan_checkpointing

__all__ = ["ActivationPlan", "RegionDecision", "SpanDecision", "plan_checkpointing"]
