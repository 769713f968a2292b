"""A schedule walked with the vocabulary exchanges (``plan/schedule/vocab.py``'s ``vocab_joins``):
receives wait for their sends, bounded sends for their link's window (``walk.bounded_sends``), an
output exchange for every rank to reach it, an embedding lookup on stage 0 for every rank to reach
it, and a rank serving a lookup for stage 0 to reach it. Returns how far each rank gets (0: the end)."""

from megatron_slim.plan.schedule.vocab import EmbeddingJoin, vocab_joins
from megatron_slim.plan.schedule.walk import bounded_sends, produced, required, window_waits


def events(schedule, rank, joins_of=vocab_joins) -> list:
    """The rank's row with ``("out", m)`` / ``("emb", (m, j))`` where it meets each exchange."""
    joins, _ = joins_of(schedule, rank)
    out: list = []
    for position in range(len(schedule.ranks[rank]) + 1):
        for join in joins.get(position, ()):
            out.append(("emb", join.lookup) if isinstance(join, EmbeddingJoin) else ("out", join.microbatch))
        if position < len(schedule.ranks[rank]):
            out.append(schedule.ranks[rank][position])
    return out


def _may_pass(event, r: int, heads: list, passed: list) -> bool:
    reached = [h == event or event in passed[q] for q, h in enumerate(heads)]
    if event[0] == "out":  # a collective: every rank has come to it
        return all(reached)
    return all(reached[1:]) if r == 0 else reached[0]  # stage 0 waits for every rank, the others for it


def walk(schedule, joins_of=vocab_joins) -> list[int]:
    rows = [events(schedule, r, joins_of) for r in range(schedule.pp)]
    window, bounded = window_waits(schedule), bounded_sends(schedule)
    pos, done, passed = [0] * len(rows), set(), [set() for _ in rows]
    moved = True
    while moved:
        moved = False
        heads = [row[p] if p < len(row) else None for row, p in zip(rows, pos)]
        for r, row in enumerate(rows):
            if pos[r] >= len(row):
                continue
            e = row[pos[r]]
            if isinstance(e, tuple):
                ok = _may_pass(e, r, heads, passed)
            else:
                needs = required(schedule, r, e) + ([window[(r, e)]] if (r, e) in bounded else [])
                ok = all(f in done for f in needs)
            if ok:
                if isinstance(e, tuple):
                    passed[r].add(e)
                else:
                    done.add(produced(schedule, r, e))
                pos[r] += 1
                moved = True
                break  # heads changed
    return [p - len(row) for p, row in zip(pos, rows)]
