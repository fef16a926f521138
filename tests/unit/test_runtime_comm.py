"""Message tags and failure messages of planner.runtime.wire.comm (no process group needed)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import InvalidInputError, RankFailureError
from planner.runtime.wire.comm import (
    MAX_BOUNDARIES,
    MAX_MICROBATCHES,
    MAX_TENSORS,
    Kind,
    failure,
    make_tag,
    split_tag,
)

fields = st.tuples(st.sampled_from(list(Kind)), st.integers(0, MAX_BOUNDARIES - 1),
                   st.integers(0, MAX_MICROBATCHES - 1), st.integers(0, MAX_TENSORS - 1))


@given(fields, fields)
def test_tags_round_trip_and_never_collide(a, b):
    ta, tb = make_tag(*a), make_tag(*b)
    assert 0 <= ta < 2 ** 31
    assert split_tag(ta) == a
    assert (ta == tb) == (a == b)


@pytest.mark.parametrize("args", [(Kind.ACT, 0, MAX_MICROBATCHES, 0), (Kind.ACT, MAX_BOUNDARIES, 0, 0),
                                  (Kind.GRAD, 0, 0, MAX_TENSORS), (Kind.GRAD, 0, -1, 0)])
def test_out_of_range_tag_fields_are_refused(args):
    with pytest.raises(InvalidInputError):
        make_tag(*args)


@pytest.mark.parametrize("text,expected", [
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", "rank 3 died"),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation",
     "rank 3 did not answer"),
    ("something else broke", "rank 3 failed: something else broke"),
])
def test_backend_errors_become_rank_failures_naming_the_peer(text, expected):
    err = failure(RuntimeError(text), peer=3, doing="receiving 1RECV_F0<3")
    assert isinstance(err, RankFailureError)
    assert str(err).startswith(expected) and "1RECV_F0<3" in str(err)
    assert err.peer == 3
