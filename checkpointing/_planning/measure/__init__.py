"""The planner's measuring wing: running the model and turning what it saw into a problem.

In data-flow order: ``profile.py`` runs the model at plan time (one forward, one recorded step,
one plain step for the peak: Rules M7 and M8) and finds the tail's modules (Rule M10);
``steps.py`` is a step's loss and backward; ``recorder.py`` watches the recorded step
(``flops.py`` counts an op's FLOPs, ``kept_span_watch.py`` tells a kept span's ops and saves
apart, Rule M14); ``live_bytes.py`` reads the peaks of a plain step's memory and ``scratch.py``
the kernels' work buffers (Rule S6); ``costs.py`` prices ops, policies, frames and recorded spans
(Rule M8); ``step_profile.py`` holds what the step saw as data and states it as the solver's
problem; ``recorded_spans.py`` is what the head, the tail and the trails saw and the problems
with them recorded (Rules M11 and M13); ``trials.py`` times candidate plans on the model, opt-in
(Rule M12); ``shapes.py`` runs the steps on fake tensors for a model on the meta device (NOTE
[Planning without memory]). A model family's quirk (an op the recorder must pass by, a module it
must tell apart) belongs here. Nothing here installs a plan (``apply``) or chooses one (``solve``).

Measurements behind the rules are in benchmarks/RESULTS.md ("Planner model: measurements behind
the rules").

NOTE [Planner measure]
  Rule M1. Bytes are storages: a tensor kept for backward costs its whole storage, once, however
           many views of it are kept and however many ops keep it (as the saved-tensor report counts
           them).
  Rule M2. Activations are the storages produced by ops during the step; the parameters, buffers and
           example inputs (and anything made before the step) are not: they stay in memory whatever
           is checkpointed. Tensors that do not require grad but are saved (dropout masks, attention
           masks made in forward) are activations: they take memory.
  Rule M3. An op inside a region is keyed by its overload and its occurrence index among that
           overload's calls in one call of the region, counting as selective checkpointing counts
           (``SAC_IGNORED_OPS`` skipped; NOTE [Selective checkpoint cache], Rule 3), so the policy
           installed by ``apply`` sees in forward the keys the profile saw, and recompute replays
           the forward's decisions.
  Rule M4. Views cost nothing: an op whose outputs share an input's storage is never saved (its base
           is) and is always re-run in recompute, where it is free.
  Rule M5. In-place groups share their producer's fate: a storage written in place inside a region
           (and the op that made it) is recomputed, never saved: a saved producer would be
           version-checked against its later writes, a saved writer would not re-apply its write to
           the recomputed base.
  Rule M6. Random ops (and everything in their in-place group, e.g. dropout's mask) are recomputed
           (NOTE [Selective checkpoint cache], Rule 10), unless the region keeps its draws as a
           group (Rule S7).
  Rule M7. Profiling leaves the model as found: parameters (values and ``.grad``: gradients go
           through ``torch.autograd.grad``, Rule M15), buffers (copied back where written:
           BatchNorm's statistics), CPU and CUDA RNG states (``torch.random.fork_rng``), module
           hooks (removed), and the caller's modes (the profiled steps run with grad enabled, also
           under ``no_grad`` or ``inference_mode``). ``_untouched.untouched`` is the one mechanism;
           ``checkpoint_sequential`` measures its chain under it too.
  Rule M8. Prices are counted, never timed. An op's seconds are the cost model's (``costs.py``): a
           dispatch cost, its FLOPs (``flops.op_flops``) at the device class's FLOP rate, and the
           bytes it reads and writes (its tensor arguments' elements, none for an op that reads only
           metadata, and its outputs' in storages of their own or written in place; a view moves
           none) at the class's bandwidth, and the random numbers it draws at the class's price per
           number (a CPU draws ~10x slower than it moves the bytes, so a replayed dropout priced by
           its bytes alone made three selective blocks look as cheap as two whole ones, and they
           were measurably slower); summed over the region's calls. Why: the plan must be a
           function of the model, the inputs, the budget and the options (two calls, two ranks, one
           plan), and measured op times made it one of the machine's noise as well; the model errs
           alike for every plan it compares. Identical blocks get equal prices by construction (the
           same ops on the same shapes), so they pose one problem (Rule S5). The profile records one
           step (and runs one forward before it, one plain step after it for the peak, Rule S6): the
           model runs three times at plan time. The constants (one set per device class) are
           measured by ``benchmarks/planner.py --cost-model``; their values, machine and date are in
           RESULTS.md. The named accelerators' (``device="h100-80gb"``...) FLOP rates and bandwidths
           are their vendor's datasheet peaks, for plans made for a device this machine lacks;
           matrix work in float32 is priced at the class's float32 rate.
  Rule M9. Early stop. A checkpoint's frame has a holder for every tensor autograd saves in the
           region (parameters included) and its recompute stops once the last is filled (NOTE
           [Nestable checkpoint]); an op's inputs are saved before it runs, its outputs after. The
           profile notes, per region call, how many ops had run when the last save happened; the ops
           after that cost nothing to recompute and keeping their outputs saves nothing, so they are
           neither charged nor offered (a Llama block's down projection: its input is the last
           save). Before the stop, the replay may skip the ops whose outputs nothing needs (Rule
           S8).
  Rule M10. The tail as regions. By default (``regions=None``) the modules the model calls after its
            last block (every call of one starting after the blocks' last call ended: a Llama's
            final norm and LM head) are regions too, outermost ones, found by one forward before
            profiling; the solver checkpoints them or not like the blocks, or records them whole
            (Rule M11). Work after the tail's last module (a loss computed in the model's own
            ``forward``, as Hugging Face models do) stays outside every region.
  Rule M11. Spans around the blocks. Module frames keep their inputs, so a model of N blocks keeps N
            + 1 residual-stream tensors at their boundaries (the first block's input, the tail's)
            where torch.compile's partitioner keeps N (it recomputes the embedding and the final
            norm from what it keeps). By default the plan may record two spans with a
            ``gradient_checkpoint_scope`` (``recorded_spans.py``): the head, from the model's start
            to its first block's (the embedding, rotary angles), and the tail, from its first tail
            module's start to its last one's end (Rule M10). Every storage a recorded span makes is
            kept nowhere: whoever saves it (a block's frame as its positional input, a plain region,
            an op outside the regions) gets a holder, and backward replays only the ops that make
            what it unpacks (NOTE [Gradient checkpoint scope], Rules 2 and 7); the activations it
            reads from outside (the last block's output) are kept by its tape; a frame's keyword or
            nested inputs are kept by plain reference all the same; the tail's modules run plainly
            inside it. A session opened at the model's start and closed at its end keeps our
            saved-tensors hook on the stack whatever the caller pushed (a report, ``save_on_cpu``):
            the head's tensors are saved after its scope closed (Rule 4 there). At the model's end
            the spans give up their claims on that hook, so none of ours stays on the caller's stack
            after the step; a span's tensor saved after the model's forward returned (by a loss
            computed outside it) is kept, and the profile counts it so. A model call under
            ``no_grad``, in a recompute or inside a checkpoint's frame (the whole planned model
            checkpointed again) records no span: that frame must see every save, in forward and in
            recompute alike. A recorded span pays its replay and its recording: per op, priced as
            the selective modes, and per call the cost model's ``span_call_seconds``, what a scope
            and its session cost beyond that (without it a trail's machinery went unpriced, Rule
            M13). The solver solves the step with each subset of the spans recorded (at most four
            problems) and takes the cheapest that fits; the floor is the lowest. A span is not
            offered where it draws random numbers (its tape would keep an RNG state per draw,
            uncounted), writes in place a tensor it did not make (an argument the op's schema marks
            as written, or batch norm's running statistics in training, which it does not mark, as
            the scope's tape counts them: a parameter, a buffer, an earlier activation), or frees
            nothing; nor with a ``regions`` predicate. Why: that one boundary per model is what
            stood between the plans and the compiler's FLOPs.
  Rule M12. Determinism, and what a frame costs. A checkpointed region costs more than its ops'
            recompute (its frame, the holders, the recompute's graph): the solver charges the cost
            model's ``frame_seconds_per_op`` per op its replay runs, per call
            (``RegionChoices.frame_seconds``), in the cost it minimizes, never in the predicted
            seconds (those are the ops' own, Rule M8). With counted prices (Rules M8, S3 and M11) a
            plan is a function of the model (its structure, shapes and dtypes; where ops depend on
            values, such as a router's, the values), the example inputs, the budget, the options and
            the device class's constants: two calls give one plan, and so do the ranks of a job
            given the same inputs, with no collective (a rank may plan alone). Timing is opt-in
            (``timing_steps > 0``; the default 0 times nothing): the solver then also solves with
            the two least sure prices moved (``search._PERTURBED``: the policy's halved and doubled,
            the frame's dropped, and doubled with the policy's halved), every plan priced by the
            model whatever drew it; where that gives more than one distinct plan, each is applied
            and timed on the model (``trials.py``): every plan once a round, the order turned, a
            warm-up round first, the garbage collector off (its youngest generation collected
            between rounds), each step divided by its round's mean; a plan leaves once the one of
            least median so far beat it in so many rounds that a coin would have done it with a
            chance below 1 % (a sign test: seven rounds at the least); the rounds end when one is
            left, or after ``timing_steps``. The fastest is returned with the timings
            (``ActivationPlan.timed``). Measured times differ between ranks, so where a default
            process group is initialized every rank returns rank 0's choice (its JSON broadcast;
            every rank must call). Why opt-in: the race cost up to six candidates times 7-24 rounds
            of steps (a small GPT planned in 224 s by default, 29 s without it) for a gain measured
            at 2-3 % on CPU, and it made the plan a function of the machine's load. The model,
            ``.grad`` and the RNG states are left as found (Rule M7); no plan stays applied,
            whatever a step raises.
  Rule M13. Trails. A post-norm block ends by calling its final norm on a residual sum (``norm2(h +
            ff)``), and the next block's frame keeps the norm's output as its input; a plan that
            keeps the sum, to skip the matmul behind it, kept that boundary twice, where
            torch.compile's partitioner keeps the sum and remakes the norm. The profile notes per
            block (blocks only, one call per step) the child module it calls last: once, with no op
            after it, its output the block's; and what the block had saved, and its early stop (Rule
            M9), when the child started (``profile.Trail``). The plan may record every block's such
            child as a trail, all of them or none (beside the head and tail subsets: at most eight
            problems): the block's region ends where the child starts (``end_at``: its frame ends in
            the child's pre-hook, and its recompute there too, by early stop or, where early stop is
            off, by that hook; NOTE [Module checkpoint hooks], Rule 7), and a
            ``gradient_checkpoint_scope`` records the child as a span (Rule M11): what it makes (the
            next block's input, the norm's statistics) is kept nowhere, what it reads (the sum) is
            kept by its tape, its replay and its recording are paid. The region's problem is the
            profile cut at the child: its ops, saves and early stop as they were then. A trail none
            of whose storages anyone else keeps (the last block's, whose output only the loss reads)
            is left out; so is one that draws random numbers or writes what it did not make (Rule
            M11's conditions). Pre-norm blocks (a Llama's, GPT-2's, a ViT's) end in a residual add,
            not a child call: no trail. Why: the boundary kept twice is what kept post-norm plans
            above the compiler's FLOPs at its bytes. Where the race runs (``timing_steps > 0``, Rule
            M12), the cheapest plan without trails is one more candidate of it when the prediction
            chose trails: their machinery is priced per call (Rule M11) by a constant, and a timed
            step is where such a constant's error shows. Under ``torch.compile`` the blocks are
            torch's regions, whole: the end hook returns at once while dynamo traces.
  Rule M14. Kept spans. In a checkpointed region the ops of a ``keep(fn, *args)`` span are neither
            counted nor cached by the selective modes, nor replayed (NOTE [Kept spans], Rule 6):
            they are the span's, not the policy's. The profile runs the model without checkpointing,
            where ``keep`` would be a plain call, so its pack hook (``kept_span_watch.SpanWatch``)
            asks ``keep`` for the span (NOTE [Kept spans], Rule 11) and runs it under the span's
            marker: the ops inside are not the region's (not numbered, so they shift no key of Rule
            M3; not priced nor offered, nor in the replay graph or the draws), and what reads the
            span's outputs reads a storage the replay is served. A save inside the span that is one
            of its arguments or a view of one is a holder, as the frame makes it (the argument's
            producer is needed, Rule S8; the early stop moves, Rule M9); any other is kept by the
            span and is the region's whenever it is checkpointed (``RegionProfile.kept``, charged
            with its inputs), as are the span's outputs that are no view of an argument once a
            holder is made at or after the span's start (early stop releases the others).
            Un-checkpointed, the span is a plain call and the region keeps what autograd saves, the
            span's saves included. Rule S7's draws modes pass a span's ops by as the selective ones
            do, so a region that keeps its draws keeps its spans too. Why the watch and not the
            profile under checkpoint: what autograd saves would hide behind the frame's holders (see
            Rejected); why in the pack hook: ``keep`` decides by the top saved-tensors hook (Rule 1
            there), and a hook of the user's or a span inside a span makes it a plain call in the
            profile as at run time. A region that runs a ``with keeping():`` block is planned
            without recompute (``RegionProfile.kept_blocks``; plain-only, as a tail module recorded
            in a span is, Rule M11): in the profile a block is a plain call, its ops numbered there
            and not at run time (so a policy's keys would name other ops), and what it keeps is
            everything it saves while its replay runs it again; run plainly, the region keeps what
            autograd saves, which the profile counts exactly. Why not modelled as a span: the watch
            learns where a block starts, never where it ends. Not modelled: a span's RNG states, a
            span's host copies (offload policies, counted as kept) and early stop turned off (every
            span's outputs are then held).
  Rule M15. Sharded models. Parameters are never activations, sharded or gathered: a ``DTensor``'s
            memory is its local shard's (NOTE [Storage keys], Rule 3), so the shards of FSDP2 and of
            tensor parallelism are leaves (Rule M2) like any parameter; FSDP2's unsharded parameters
            are made during the forward by its own ops (``fsdp::``, and ``c10d::`` collectives in
            place on its buffers), at addresses an earlier activation may have had, so what those
            ops make or fill loses any id it had and the ops are not the region's (the recorder
            passes them by; they are the sharding's, not the plan's). Functional collectives
            (``_c10d_functional::``, tensor parallelism's; ``_selective``'s ``is_collective``) make
            activations and are kept, never re-run: a checkpointed region that runs one keeps its
            outputs (in ``RegionProfile.kept``, charged with its inputs, as a kept span's saves are,
            Rule M14) and its plan lists its collectives among what it saves
            (``RegionDecision.save``), so ``apply`` gives it a selective policy (Rule A1), under
            which the collective rule keeps them (NOTE [Collectives under selective checkpointing]);
            a plain checkpoint would run them again in backward (a second round of communication,
            and ranks out of step where their recomputes differ). The recorder gives such an op no
            price and no unit: in the replay it runs not and needs nothing (a view's role, Rule S8),
            so what only it reads may be skipped. The region's options that keep and skip nothing
            else are priced without the selective modes' charge (Rule S3) that its collectives'
            policy adds: under by that charge, a price, never bytes.
            A measured step differentiates with ``autograd.grad`` with respect to every leaf its
            graph reaches, FSDP2's gathered parameters included: the whole backward runs, so FSDP2's
            hooks run and reshard as after a real step, and no ``.grad`` is written, so there is
            nothing for them to reduce into the sharded gradients (a backward that accumulated, its
            ``.grad`` put back after, left the root's gathered parameters' reductions in the sharded
            gradients and added in place to a gradient already there). A ``DistributedDataParallel``
            runs the profile under its ``no_sync()`` (``untouched``), so its reducer counts no
            iteration; one with ``static_graph=True`` that has not run its first step is refused
            (that step's backward records the graph). Every rank profiles its own share: FSDP2's
            rank plans its own rows, a tensor-parallel rank its own shard of the split activations.

Rejected: profiling under checkpoint with a save-everything policy (what autograd saves is then
hidden behind the frame's holders); timing whole steps with every region checkpointed, plainly
and under the policy, to price the policy (the difference is a few percent of a step, below the
step-to-step noise of a few steps on a shared machine; Rule M12 times whole plans against each
other instead, round by round, only where the prices disagree); and torch's ``SACEstimator``
(private, CUDA-oriented, and it counts per tensor, not per storage).
"""
