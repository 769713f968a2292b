import pytest

from megatron_slim.plan.schedule import (
    Action,
    ScheduleError,
    add_communication,
    generate,
    merge_backward,
    split_backward,
    strip_communication,
    validate,
)


def _edit(schedule, rank, fn):
    rows = [list(r) for r in schedule.ranks]
    rows[rank] = fn(rows[rank])
    return schedule.replace_ranks(rows)


def test_missing_action_is_reported():
    s = _edit(generate("1f1b", 2, 1, 3, 1), 1, lambda r: r[:-1])
    with pytest.raises(ScheduleError, match="missing"):
        validate(s)


def test_duplicate_action_is_reported_with_its_step():
    s = _edit(generate("1f1b", 2, 1, 3, 1), 0, lambda r: r + [r[0]])
    with pytest.raises(ScheduleError, match="rank 0 step 6: F0.0 appears twice"):
        validate(s)


def test_out_of_range_action_is_reported():
    s = _edit(generate("1f1b", 2, 1, 3, 1), 0, lambda r: r[:-1] + [Action.parse("B7.0")])
    with pytest.raises(ScheduleError, match="outside the schedule"):
        validate(s)


def test_backward_before_its_forward_is_a_dependency_error_marked_in_the_grid():
    def swap(row):
        i = next(k for k, a in enumerate(row) if str(a) == "B0.0")
        row[0], row[i] = row[i], row[0]
        return row

    s = _edit(generate("1f1b", 2, 1, 3, 1), 1, swap)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "rank 1 step 0 B0.0 waits for: F0.0 on rank 1" in msg
    assert ">B0.0<" in err.value.grid and "rank 1" in err.value.grid


def test_cross_rank_deadlock_is_found():
    # rank 0 waits for a backward that rank 1 only runs after a forward rank 0 never sends
    s = generate("1f1b", 2, 1, 2, 1)
    rows = [["F0.0", "B0.0", "F1.0", "B1.0"], ["F0.0", "F1.0", "B1.0", "B0.0"]]
    bad = s.replace_ranks([[Action.parse(a) for a in r] for r in rows])
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(bad)


def test_reversed_slice_backward_order_is_rejected():
    s = generate("slimpipe", 1, 1, 1, 2)  # F0.0 F0.1 B0.1 B0.0
    bad = s.replace_ranks([[Action.parse(a) for a in ["F0.0", "F0.1", "B0.0", "B0.1"]]])
    with pytest.raises(ScheduleError, match="B0.0 waits for: B0.1"):
        validate(bad)


def test_unmatched_send_is_reported():
    s = add_communication(generate("1f1b", 2, 1, 2, 1))
    bad = _edit(s, 1, lambda r: [a for a in r if str(a) != "RECV_F1.0"])
    with pytest.raises(ScheduleError, match="SEND_F1.0 has no matching RECV"):
        validate(bad)


def test_lowering_passes_round_trip():
    s = generate("slimpipe", 3, 2, 4, 3)
    assert strip_communication(add_communication(s)) == s
    assert merge_backward(split_backward(s)) == s


@pytest.mark.parametrize(
    "kind,pp,vpp,m,n",
    [("1f1b", 4, 1, 5, 1), ("interleaved", 3, 2, 4, 1), ("slimpipe", 4, 2, 3, 8), ("slimpipe", 2, 1, 2, 3)],
)
def test_every_cross_rank_dependency_is_sent_after_production_and_received_before_use(kind, pp, vpp, m, n):
    s = add_communication(generate(kind, pp, vpp, m, n))
    for rank, row in enumerate(s.ranks):
        names = [str(a) for a in row]
        for i, a in enumerate(row):
            if a.kind.value in ("F", "B"):
                stage = s.stage(rank, a.chunk)
                needs_recv = (a.kind.value == "F" and stage > 0 and s.placement(stage - 1)[0] != rank) or (
                    a.kind.value == "B" and stage < s.num_stages - 1 and s.placement(stage + 1)[0] != rank
                )
                unit = str(a)[len(str(a.chunk)) if a.chunk else 0 :][1:]
                recv = ("RECV_F" if a.kind.value == "F" else "RECV_B") + unit
                recv = (str(a.chunk) if a.chunk else "") + recv
                assert (names[i - 1] == recv) == needs_recv


def test_link_order_mismatch_is_found_and_the_receive_ordering_pass_fixes_it():
    from megatron_slim.plan.schedule import check_link_order, lower, order_receives_by_link

    plain = add_communication(generate("slimpipe", 2, 2, 5, 1))  # pp=2: one link carries F and B
    with pytest.raises(ScheduleError, match="order differs; NCCL would mismatch"):
        check_link_order(plain)
    fixed = order_receives_by_link(plain)
    validate(fixed)
    check_link_order(fixed)
    assert lower(generate("slimpipe", 2, 2, 5, 1)) == fixed
    assert sorted(map(str, fixed.ranks[1])) == sorted(map(str, plain.ranks[1]))  # only moved


@pytest.mark.parametrize("pp,vpp,m,n", [(2, 2, 2, 3), (2, 3, 9, 1), (2, 2, 8, 3), (3, 2, 5, 2), (4, 3, 3, 4)])
def test_lowered_schedules_are_nccl_safe(pp, vpp, m, n):
    from megatron_slim.plan.schedule import check_link_order, lower

    s = lower(generate("slimpipe", pp, vpp, m, n))
    validate(s)
    check_link_order(s)


@pytest.mark.parametrize(
    "kind,vpp,m,n",
    [("1f1b", 1, 3, 1), ("slimpipe", 1, 4, 3), ("slimpipe", 2, 3, 2), ("interleaved", 2, 4, 1), ("1f1b", 1, 1, 1)],
)
def test_one_stage_schedules_are_lowered_as_generated(kind, vpp, m, n):
    """pp=1: every stage is on one rank, so lowering adds no messages and changes nothing."""
    from megatron_slim.plan.schedule import check_link_order, lower, order_receives_by_link

    s = generate(kind, 1, vpp, m, n)
    assert s.is_lowered and not s.has_communication
    assert add_communication(s) == s and order_receives_by_link(s) == s and lower(s) == s
    validate(lower(s))
    check_link_order(lower(s))


def test_adding_communication_twice_is_refused():
    s = add_communication(generate("1f1b", 2, 1, 2, 1))
    with pytest.raises(ValueError, match="already has SEND/RECV"):
        add_communication(s)


def _reference_order_receives_by_link(schedule):
    """The receive-ordering pass as first written (rebuilds ``set(messages)`` per action):
    the linear-time pass must give exactly this."""
    from megatron_slim.plan.schedule import Kind

    send_order: dict = {}
    for rank, row in enumerate(schedule.ranks):
        for a in row:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                stage = schedule.stage(rank, a.chunk)
                dst_stage = stage + 1 if a.kind is Kind.SEND_F else stage - 1
                dst, dst_chunk = schedule.placement(dst_stage)
                recv = Action(Kind.RECV_F if a.kind is Kind.SEND_F else Kind.RECV_B, dst_chunk, a.microbatch, a.slice)
                send_order.setdefault((rank, dst), []).append(recv)
    rows = []
    for rank, row in enumerate(schedule.ranks):
        row = list(row)
        for (_src, dst), messages in send_order.items():
            if dst != rank:
                continue
            position = {a: i for i, a in enumerate(row) if a in set(messages)}
            slots = [position[m] for m in messages]
            wanted = slots[:]
            for k in range(len(wanted) - 2, -1, -1):
                wanted[k] = min(wanted[k], wanted[k + 1])
            if wanted == slots:
                continue
            keys = {a: (i, 1, 0) for i, a in enumerate(row)}
            for k, (m, w) in enumerate(zip(messages, wanted)):
                keys[m] = (w, 0, k)
            row = sorted(row, key=keys.__getitem__)
        rows.append(row)
    return schedule.replace_ranks(rows)


@pytest.mark.parametrize(
    "kind,pp,vpp,m,n",
    [
        ("slimpipe", 2, 2, 5, 1),
        ("slimpipe", 2, 3, 9, 2),
        ("slimpipe", 3, 2, 5, 2),
        ("slimpipe", 4, 3, 3, 4),
        ("slimpipe", 4, 1, 6, 3),
        ("interleaved", 2, 2, 4, 1),
        ("interleaved", 4, 2, 8, 1),
        ("1f1b", 3, 1, 5, 1),
    ],
)
def test_receive_ordering_pass_matches_its_reference(kind, pp, vpp, m, n):
    from megatron_slim.plan.schedule import order_receives_by_link

    s = add_communication(generate(kind, pp, vpp, m, n))
    assert order_receives_by_link(s) == _reference_order_receives_by_link(s)
