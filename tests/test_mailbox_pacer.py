"""The pause between passes of a polling role loop (`rollart_hpc.cluster.mailbox.Pacer`): the floor after a
pass that found work, doubling over idle passes, never above the ceiling."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollart_hpc.cluster.mailbox import Pacer


def test_idle_passes_double_the_pause_up_to_the_ceiling_and_work_resets_it():
    pacer = Pacer(floor_s=0.0005, ceiling_s=0.004)
    assert [pacer.pause_s(False) for _ in range(5)] == [0.001, 0.002, 0.004, 0.004, 0.004]
    assert pacer.pause_s(True) == 0.0005
    assert pacer.pause_s(False) == 0.001


@given(
    st.floats(1e-5, 0.01),
    st.floats(1.0, 100.0),
    st.lists(st.booleans(), max_size=60),
)
def test_pauses_stay_between_floor_and_ceiling_and_a_busy_pass_gets_the_floor(floor, ratio, passes):
    pacer = Pacer(floor_s=floor, ceiling_s=floor * ratio)
    for busy in passes:
        pause = pacer.pause_s(busy)
        assert pacer.floor_s <= pause <= pacer.ceiling_s
        if busy:
            assert pause == pacer.floor_s


@pytest.mark.parametrize(("floor", "ceiling"), [(0.0, 0.004), (-1.0, 0.004), (0.01, 0.004)])
def test_a_floor_outside_zero_to_ceiling_is_refused_in_one_line(floor, ceiling):
    with pytest.raises(ValueError, match="0 < floor_s <= ceiling_s"):
        Pacer(floor_s=floor, ceiling_s=ceiling)
