"""Which of a backward's chains replay together, and in which order.

Owns ``_Chains`` (a tape's groups split into chains, worked out at its first replay), the chains
of other tapes linked to one (``_linked_chains``) and the linked replay that a holder's first
unpack starts (``_replay_linked``): each tape involved planned from the last to close back, then
run in the order they closed. Running one tape's share (``needed_ops``, ``run``, ``fill``) and the
draw each random op records are the tape's (``tape.py``).

NOTE [Gradient checkpoint scope] (Rule 7 here; ``__init__`` says where the others are)
  Rule 7. A tape splits into chains: tensors linked by an op that reads one and makes or
          writes the other. A backward replays only the chains whose holders it unpacks (with
          ``torch.autograd.grad(loss_1, p1)``, not the chain only ``loss_2`` needs), and in them
          only the ops live holders need. Each random op replays from the state its generator
          (CPU, per device, explicit ``generator=``) had just before it drew, so every draw is
          bit-identical whichever others are replayed, and each generator is back where the
          caller had it afterwards. Host syncs (``.item()``) produce no tensor and are never
          replayed.

Rejected: replaying every random op in its original order from each generator's first state (it
pulled every chain with a random op into every replay); noting chains while recording (a cost per
op in forward; they are worked out once per tape at its first replay instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import _Entry

if TYPE_CHECKING:  # annotations only: ``tape`` imports this module (see ``__init__``)
    from .tape import _Tape, _Values


class _Chains:
    """A tape's groups split into chains: two groups are in one chain when an op links them
    (reads one and creates or writes the other). Per chain, the other tapes' tensors it reads.
    Worked out at the first replay, from the tape, not while recording."""

    __slots__ = ("count", "foreign", "group_of", "of_group", "size")

    def __init__(self, tape: _Tape) -> None:
        # Union-find where a chain's root is its lowest group (``parent[g] <= g``), so that
        # the roots come out in one pass below; the walks are inline (no call per op).
        parent = list(range(len(tape.group_of)))
        for op in tape.ops:
            linked = op.reads + op.touches
            if len(linked) < 2:
                continue
            top = linked[0]
            while parent[top] != top:
                parent[top] = top = parent[parent[top]]
            for group in linked[1:]:
                while parent[group] != group:  # none for a group this op made
                    parent[group] = group = parent[parent[group]]
                if group > top:
                    parent[group] = top
                elif group < top:
                    parent[top] = top = group
        for group, up in enumerate(parent):  # ``up`` is done: ``up <= group``
            parent[group] = parent[up]
        self.of_group = parent
        self.count = len(set(self.of_group))
        self.foreign: dict[int, list[tuple[_Tape, int]]] = {}
        for op in tape.ops if tape.reads_others else ():
            linked = op.reads + op.touches
            for leaf in op.leaves:
                if type(leaf) is _Entry and linked:
                    chain = self.of_group[linked[0]]
                    self.foreign.setdefault(chain, []).append((leaf.tape, leaf.slot))
        self.size = len(tape.ops)
        self.group_of = tape.group_of

    def chain_of(self, slot: int) -> int:
        return self.of_group[self.group_of[slot]]


def _linked_chains(tape: _Tape, slot: int) -> dict[_Tape, set[int]]:
    """The chains replayed together with the one of ``tape``'s ``slot``: the chains of other
    tapes it reads, and those of later tapes that read it, transitively (Rule 3)."""
    found = {tape: {tape.chains().chain_of(slot)}}
    todo = [(tape, chain) for chain in found[tape]]
    while todo:
        current, chain = todo.pop()
        chains = current.chains()
        links = [(t, t.chains().chain_of(s)) for t, s in chains.foreign.get(chain, ())]
        for ref in current.readers:
            reader = ref()
            if reader is None:
                continue
            links += [
                (reader, reading)
                for reading, reads in reader.chains().foreign.items()
                if any(t is current and chains.chain_of(s) == chain for t, s in reads)
            ]
        for other, other_chain in links:
            known = found.setdefault(other, set())
            if other_chain not in known:
                known.add(other_chain)
                todo.append((other, other_chain))
    return found


def _replay_linked(tape: _Tape, slot: int, key: object) -> None:
    """Fill, for backward ``key``, every waiting holder of the chains linked to ``slot``,
    replaying each tape involved once (Rules 2, 3 and 7). Tapes are planned from the last to
    close back (what each needs of the tapes it reads), then run in the order they closed."""
    linked = _linked_chains(tape, slot)
    wanted: dict[_Tape, set[int]] = {}  # slots that later tapes read
    plans = []
    for current in sorted(linked, key=lambda t: t.order, reverse=True):
        holders = current.waiting(linked[current], key)
        groups = {current.group_of[h.slot] for h in holders}
        groups.update(current.group_of[s] for s in wanted.get(current, ()))
        ops = current.needed_ops(groups)
        for op in ops:
            for leaf in op.leaves:
                if type(leaf) is _Entry:
                    wanted.setdefault(leaf.tape, set()).add(leaf.slot)
        plans.append((current, holders, ops))
    foreign: _Values = {}
    for current, holders, ops in reversed(plans):
        values = current.run(ops, foreign)
        foreign.update({(current, s): values[s] for s in wanted.get(current, ())})
        current.fill(holders, values, key)
