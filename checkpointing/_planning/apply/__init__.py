"""The planner's applying wing: the plan object and what it installs on a model at run time.

In data-flow order: ``plan.py`` is the result (``ActivationPlan``: per-region and per-span
decisions, installing them, all or nothing, and taking them off; Rule A1); ``plan_json.py``
writes and reads plans; ``contexts.py`` is a planned region's selective policy, ``draws.py`` its
kept random draws (Rule S7) and the alarm of a region planned without draws (Rule A3);
``installed.py`` is what ``apply`` put on the model (the input-shape check, Rule A2; the draw
guard, Rule A3) and takes a plan off a model or a copy; joined regions run as one chain (Rule
A4); ``span_hooks.py`` records the planned
spans (Rules M11 and M13). A new run-time mechanism of a plan belongs here; what to install is
decided in ``solve``.

NOTE [Planner apply]
  Rule A1. ``apply`` installs ``checkpoint_module`` (non-reentrant; names and ``state_dict`` keys
           untouched) on each checkpointed region, with a selective policy only where it keeps,
           offloads or skips something (Rule S8): a region that keeps and skips nothing runs as
           plain checkpoint.
           A region that keeps its draws gets the draws modes (Rule S7), under the selective ones
           where it keeps outputs too.
  Rule A2. Inputs whose shapes differ from the profiled ones warn once per ``apply`` ("re-plan"):
           the bytes and times describe the profiled shapes only. Calls under ``no_grad`` keep
           nothing and never warn. Positional inputs are compared in order, keyword ones by name
           (whatever order the call gives them in); 0-d tensors are left out: a scalar (a loss's
           token count, a temperature) changes its value, never its shape or the bytes kept, and
           comes and goes between calls.
  Rule A3. A checkpointed region keeps what its frame keeps (NOTE [Nestable checkpoint], Rule 11):
           its input activations, those received by keyword or inside a container included, and, if
           it draws, the RNG states it captures. A region draws where a call of it ran a random op
           (a kept span's included): its own ops, on the profiling thread, which the recorder's
           dispatch mode sees; never a comparison of the process's generator state, which another
           thread's draws (a data loader's, a sampler's) move too, so the plan is the same whatever
           else the program draws. A region that only sets a generator (``torch.manual_seed`` or
           ``set_rng_state`` in its forward) draws nothing: its gradients are right, and its
           recompute sets the generator again during backward, as torch's checkpoint without
           ``preserve_rng_state`` does. ``RegionDecision.draws`` records it (unknown, from older
           JSON or pickles: drawing). ``apply`` preserves RNG state only for drawing regions: one
           that draws nothing keeps no state and is charged none, since its recompute draws nothing
           either. That is safe only while it really draws nothing, hence for planned regions only,
           each under a ``DrawGuard`` (``installed.py``), which is its ``context_fn``: its hooks
           compare the CPU generator's state, and each accelerator's among the region's inputs,
           before and after each forward under grad, as bytes; where none moved the call drew
           nothing (but inside ``torch.random.fork_rng``, which moves nothing: the profile sees such
           draws all the same, so only a model that starts drawing after planning can do that);
           where one moved, by the call's draws or another thread's, the call's recompute runs under
           an alarm (``draws.guarded_replay``) that raises ``CheckpointError`` at the first random
           op the recompute runs, before it draws: a model planned in eval mode and trained in train
           mode. The recompute's own ops decide, so another thread's draws raise nothing, and a draw
           the recompute never runs (after the early stop, Rule M9) harms nothing and raises
           nothing. What the guard holds per thread is a ``threading.local``, gone with the thread.
           Why not a dispatch mode in every forward: it would check every op of every call; the
           hooks read two generator states per call, the alarm runs only where one moved (costs in
           benchmarks/RESULTS.md). Under ``torch.compile`` the guard stands aside: torch's region
           gets the region's own contexts, and its partitioner keeps random ops' outputs. Under the
           debug report (``set_checkpoint_debug_enabled``), whose op loggers are a checkpoint's
           contexts, the guard stands in as the region's own contexts (``stand_in``) and its hooks
           check the forward itself: a moved generator raises there (another thread's draws too,
           while debugging). Profiling captures the states at each call as the frame does
           (``ForwardState``) and keeps only the drawing regions' ones; a CPU capture with no random
           op of the step since the previous capture is that capture's storage, kept if any drawing
           region sharing it is checkpointed: the frame shares a state identical to its previous
           capture, and draws only move the stream on. The real run captures fewer states than the
           profile (draw-free and unplanned regions capture none), so it shares at least where the
           profile does, unless another thread draws between two drawing regions' calls: the frame
           then shares less (one CPU state more per such call: under by that, the one place where
           the count is not over). (A region that moves the stream back, e.g. by reseeding, is
           counted apart where the frame would share: over, never under.) Device states (one per
           accelerator tensor among the positional inputs) are never shared.
  Rule A4. A run of regions ``[r, joined, joined, ...]`` (``RegionDecision.joined``: the region
           continues the frame of the one before it in ``plan.regions``) is installed as one
           ``checkpoint_chain`` on ``model`` (NOTE [Checkpoint chains]): one frame, one input and
           one RNG state for the run. Every region of a run is checkpointed whole (no save,
           offload or skip: one frame has one policy, and the ops' keys count per region) and
           keeps its draws alike; ``apply`` refuses others, and a region joined to a region whose
           frame ends at a trail's start (Rule M13), with the fix. A trail of the run's last
           region ends the chain's frame (``end_chain_at``). The RNG rule of a run: its state is
           always kept (``preserve_rng_state=True``, no ``DrawGuard``), whether its regions draw
           or not: one CPU state per run (shared with an identical neighbour's, NOTE [Nestable
           checkpoint], Rule 7) and one per accelerator tensor among the first region's
           positional inputs. Rule A3's guard watches one module's forward and cannot see a later
           member's draws, so a draw-free run keeps the state the guard would have spared.
           The key/value cache pre-hooks stay per region.
"""
