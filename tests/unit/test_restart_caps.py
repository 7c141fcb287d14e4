"""The caps a multi-worker job restarts with after out of memory (hetero_cs.planning.restart_caps), pure."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetero_cs.errors import ConfigError
from hetero_cs.planning.restart_caps import format_caps, lowered_caps, lowest_caps, parse_caps

caps_lists = st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=10**9)), min_size=1, max_size=8)


@given(caps=caps_lists)
def test_the_text_reads_back_as_the_caps(caps):
    assert parse_caps(format_caps(caps), len(caps)) == caps


@given(caps=caps_lists, data=st.data())
def test_a_lowered_cap_is_below_what_ran_out_and_never_above_the_cap_in_force(caps, data):
    replica = data.draw(st.integers(min_value=0, max_value=len(caps) - 1))
    held = data.draw(st.integers(min_value=1, max_value=10**6))
    lowered = lowered_caps(caps, len(caps), replica, held)
    assert lowered[replica] < held and lowered[replica] == min(held // 2, caps[replica] if caps[replica] is not None
                                                                else held)
    assert [c for i, c in enumerate(lowered) if i != replica] == [c for i, c in enumerate(caps) if i != replica]


def test_lowering_without_caps_in_force_caps_only_that_replica():
    assert lowered_caps(None, 3, 2, 1) == [None, None, 0]  # one example did not fit: the card takes none


@pytest.mark.parametrize("replica, held", [(3, 4), (-1, 4), (0, 0)])
def test_lowering_refuses_a_replica_outside_the_cluster_or_nothing_held(replica, held):
    with pytest.raises(ValueError):
        lowered_caps(None, 3, replica, held)


def test_the_lowest_cap_of_each_replica_wins_and_none_is_no_cap():
    assert lowest_caps([None, 8, 3], [6, None, 5], None) == [6, 8, 3]
    assert lowest_caps(None, None) is None
    with pytest.raises(ValueError):
        lowest_caps([1], [1, 2])


@pytest.mark.parametrize("text", ["4", "4,x", "4,-1", "4,,5", "none;4", "4.5,3", "\u00b2,4", "\u0663,4", ""])
def test_a_bad_caps_text_names_the_variable_the_text_and_the_form(text):
    with pytest.raises(ConfigError) as raised:
        parse_caps(text, 2)
    message = str(raised.value)
    assert "HETERO_CS_MAX_BATCH_SIZES" in message and repr(text) in message and "num_replicas_in_sync=2" in message
    assert "'none,4'" in message


def test_caps_text_ignores_case_and_spaces():
    assert parse_caps(" None , 4 ", 2) == [None, 4]
