"""The instruction value type, its short string form and message matching."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InvalidInputError
from planner.instructions import (
    OPS,
    Instruction,
    format_instruction,
    message_keys,
    parse_instruction,
    parse_program,
)

EXAMPLES = {
    "1F3": Instruction(op="F", stage=1, mb=3),
    "0B12": Instruction(op="B", stage=0, mb=12),
    "1SEND_F3>2": Instruction(op="SEND_F", stage=1, mb=3, peer=2),
    "2RECV_F3<1": Instruction(op="RECV_F", stage=2, mb=3, peer=1),
    "2SEND_B3>1": Instruction(op="SEND_B", stage=2, mb=3, peer=1),
    "1RECV_B3<2": Instruction(op="RECV_B", stage=1, mb=3, peer=2),
    "2VERIFY_F3<1>4": Instruction(op="VERIFY_F", stage=2, mb=3, peer=1, dest=4),
    "2VERIFY_F3": Instruction(op="VERIFY_F", stage=2, mb=3),
    "1VERIFY_B0>1": Instruction(op="VERIFY_B", stage=1, mb=0, dest=1),
    "2VERDICT_F3<5": Instruction(op="VERDICT_F", stage=2, mb=3, peer=5),
    "1VERDICT_B3<5": Instruction(op="VERDICT_B", stage=1, mb=3, peer=5),
    "1ALLREDUCE": Instruction(op="ALLREDUCE", stage=1),
    "3OPTIM": Instruction(op="OPTIM", stage=3),
}


@pytest.mark.parametrize("text", sorted(EXAMPLES))
def test_examples_format_and_parse(text):
    assert format_instruction(EXAMPLES[text]) == text
    assert parse_instruction(text) == EXAMPLES[text]
    assert str(EXAMPLES[text]) == text


def test_boundary_is_derived():
    assert parse_instruction("2VERIFY_F3<1>4").boundary == 1  # activation into stage 2 crosses boundary 1
    assert parse_instruction("1VERIFY_B3<2>1").boundary == 1  # gradient into stage 1 crosses boundary 1
    assert parse_instruction("1VERDICT_B3<5").boundary == 1
    assert parse_instruction("1F3").boundary is None
    with pytest.raises(InvalidInputError, match="boundary"):
        Instruction(op="VERIFY_F", stage=2, mb=3, boundary=2)


@st.composite
def instructions(draw):
    op = draw(st.sampled_from(OPS))
    small = st.integers(0, 200)
    stage = draw(st.integers(1 if op in ("RECV_F", "VERDICT_F", "VERIFY_F") else 0, 64))
    kw = {}
    if op not in ("ALLREDUCE", "OPTIM"):
        kw["mb"] = draw(small)
    if op.startswith(("SEND", "RECV", "VERDICT")):
        kw["peer"] = draw(small)
    if op.startswith("VERIFY"):
        kw["peer"] = draw(st.none() | small)
        kw["dest"] = draw(st.none() | small)
    return Instruction(op=op, stage=stage, **kw)


@settings(max_examples=300, deadline=None)
@given(instructions())
def test_round_trip(ins):
    assert parse_instruction(format_instruction(ins)) == ins


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1SEND_F3", "1F3>2", "1SEND_F3<2", "1RECV_F3",
                                  "1ALLREDUCE3", "1OPTIM<2", "0RECV_F1<0", "0VERIFY_F1", "1F-3", "1 F3",
                                  "1F3<", "1VERDICT_F3>2"])
def test_parse_rejects(text):
    with pytest.raises(InvalidInputError):
        parse_instruction(text)


def test_field_checks_name_the_problem():
    with pytest.raises(InvalidInputError, match="a microbatch"):
        Instruction(op="F", stage=0)
    with pytest.raises(InvalidInputError, match="a peer rank"):
        Instruction(op="SEND_F", stage=0, mb=1)
    with pytest.raises(InvalidInputError, match="no microbatch"):
        Instruction(op="OPTIM", stage=0, mb=1)
    with pytest.raises(InvalidInputError, match="non-negative"):
        Instruction(op="F", stage=-1, mb=0)
    with pytest.raises(InvalidInputError, match="one of"):
        Instruction(op="FWD", stage=0, mb=0)


def test_message_keys_match_send_and_receive():
    # activation of mb 3 from stage 1 (rank 2) to stage 2 (rank 5)
    (send,) = message_keys(parse_instruction("1SEND_F3>5"), 2)
    (recv,) = message_keys(parse_instruction("2RECV_F3<2"), 5)
    assert send[0] == "send" and recv[0] == "recv" and send[1] == recv[1]
    # gradient of mb 3 from stage 2 (rank 5) back to stage 1 (rank 2)
    (send,) = message_keys(parse_instruction("2SEND_B3>2"), 5)
    (recv,) = message_keys(parse_instruction("1RECV_B3<5"), 2)
    assert send[1] == recv[1]
    # a verification copy to rank 7, whose verdict goes to rank 5
    (copy,) = message_keys(parse_instruction("1SEND_F3>7"), 2)
    got, verdict = message_keys(parse_instruction("2VERIFY_F3<2>5"), 7)
    (wait,) = message_keys(parse_instruction("2VERDICT_F3<7"), 5)
    assert got[1] == copy[1] and verdict[0] == "send" and verdict[1] == wait[1]
    assert message_keys(parse_instruction("2VERIFY_F3"), 5) == ()
    assert message_keys(parse_instruction("1F3"), 0) == ()


def test_parse_program():
    assert parse_program(["0F0", "0OPTIM"]) == (EXAMPLES["1F3"].__class__(op="F", stage=0, mb=0),
                                                Instruction(op="OPTIM", stage=0))
