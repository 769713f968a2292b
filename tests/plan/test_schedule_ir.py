import pytest

from megatron_slim.plan.schedule import Action, Kind, Schedule, add_communication, generate


@pytest.mark.parametrize("text", ["F3.2", "1B0.7", "SEND_F3.2", "2RECV_B10.0", "I0.0", "12W5.31"])
def test_action_string_round_trips(text):
    assert str(Action.parse(text)) == text


def test_chunk_zero_prefix_is_canonicalised():
    assert str(Action.parse("0F1.2")) == "F1.2"
    assert Action.parse("0F1.2") == Action(Kind.F, 0, 1, 2)


@pytest.mark.parametrize("bad", ["F3", "X1.2", "F-1.0", "", "F1.2.3", "SEND3.2"])
def test_malformed_action_names_the_grammar(bad):
    with pytest.raises(ValueError, match=r"\[chunk\]KIND<microbatch>.<slice>"):
        Action.parse(bad)


def test_actions_are_hashable_and_ordered():
    a, b = Action.parse("F1.0"), Action.parse("F1.0")
    assert hash(a) == hash(b) and len({a, b}) == 1
    assert sorted([Action.parse("F2.0"), a]) == [a, Action.parse("F2.0")]


@pytest.mark.parametrize(
    "kind,pp,vpp,m,n", [("1f1b", 4, 1, 6, 1), ("interleaved", 3, 2, 5, 1), ("slimpipe", 4, 2, 3, 5)]
)
def test_schedule_text_round_trips_and_digest_is_stable(kind, pp, vpp, m, n):
    s = add_communication(generate(kind, pp, vpp, m, n))
    again = Schedule.from_text(s.to_text())
    assert again == s and hash(again) == hash(s)
    assert again.digest() == s.digest()
    assert generate(kind, pp, vpp, m + 1, n).digest() != generate(kind, pp, vpp, m, n).digest()


def test_stage_placement_is_megatron_interleaved():
    s = generate("interleaved", 4, 3, 4, 1)
    assert [s.stage(1, c) for c in range(3)] == [1, 5, 9]
    assert s.placement(9) == (1, 2)
