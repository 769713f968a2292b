"""``assemble._segment`` builds the segments of every plan without the frozen dataclass's
``__init__``: it must give the very objects ``Segment(...)`` gives."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_slim.plan.cp.assemble import _segment
from megatron_slim.plan.cp.layout import Segment


def test_segment_helper_matches_the_dataclass():
    made, plain = _segment(3, 10, 20, 110, 2, 1, 4), Segment(3, 10, 20, 110, 2, 1, 4)
    assert made == plain and hash(made) == hash(plain) and repr(made) == repr(plain)
    assert made.text() == "3:10-20@110/g2c1p4" and made.length == 10
    assert _segment(1, 0, 5, 7, 0) == Segment(1, 0, 5, 7, 0)  # chunk and part default to 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.start = 0  # type: ignore[misc]


def test_segment_helper_sets_every_field():
    """A field added to ``Segment`` must be added to ``_segment`` too."""
    made = _segment(3, 10, 20, 110, 2, 1, 4)
    assert [f.name for f in dataclasses.fields(Segment)] == list(vars(made))
