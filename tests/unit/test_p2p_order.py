"""Point-to-point channels (``comm.channel``) and the posting-order checker (``planner.runtime.wire.p2p_order``)."""
from __future__ import annotations

import json

import pytest

from planner.errors import InvalidInputError
from planner.runtime.wire import comm
from planner.runtime.wire.comm import Kind, channel, make_tag, run_channels
from planner.runtime.wire.p2p_order import PostedOp, main, mismatches, parse_line, read_logs


def test_a_message_and_its_header_share_a_channel_and_kinds_boundaries_and_topics_do_not():
    assert channel(Kind.ACT, 1) == channel(Kind.TAINT_ACT, 1) == ("act", 1)
    assert channel(Kind.GRAD, 0) == channel(Kind.TAINT_GRAD, 0) == ("grad", 0)
    assert channel(Kind.VERDICT_ACT, 2) == ("verdict_act", 2)
    assert channel(Kind.VERDICT_GRAD, 2) == ("verdict_grad", 2)
    assert channel(Kind.METRICS, 0) == channel(Kind.METRICS, 3) == ("metrics",)
    assert channel(Kind.CONTROL, 9) == ("control", 9) != channel(Kind.CONTROL, 8)
    assert channel(Kind.ACT, 0) != channel(Kind.ACT, 1) != channel(Kind.GRAD, 1)


def test_a_runs_channels_hold_every_channel_its_messages_use_once_in_one_order():
    topics = [9, 0, 4]
    got = run_channels(3, topics)
    assert len(got) == len(set(got)) == 3 * 4 + 1 + 3
    used = {channel(kind, b) for kind in Kind if kind is not Kind.CONTROL for b in range(3)}
    assert used | {channel(Kind.CONTROL, t) for t in topics} == set(got)
    assert got == run_channels(3, reversed(topics))   # the same order whatever order the topics come in


def test_without_opened_channels_every_message_uses_the_default_group():
    assert comm._CHANNEL_GROUPS == {}
    assert comm.channel_group(Kind.GRAD, 0) is None


def _op(me: int, peer: int, op: str, kind: Kind, boundary: int, mb: int) -> PostedOp:
    return PostedOp(me=me, peer=peer, op=op, channel=channel(kind, boundary), tag=make_tag(kind, boundary, mb),
                    numel=4, dtype="torch.float32", doing="test")


# Rank 1 sends its activation copy (boundary 1) before its gradient of boundary 0; rank 0 receives the
# gradient first: each channel agrees, the pair as a whole does not.
CROSSING = [_op(1, 0, "send", Kind.ACT, 1, 0), _op(1, 0, "send", Kind.GRAD, 0, 0),
            _op(0, 1, "recv", Kind.GRAD, 0, 0), _op(0, 1, "recv", Kind.ACT, 1, 0)]


def test_streams_crossing_on_separate_channels_pair_per_channel_but_not_per_pair():
    assert mismatches(CROSSING) == []
    (m,) = mismatches(CROSSING, by_channel=False)
    assert (m.sender, m.receiver, m.channel, m.position) == (1, 0, None, 0)
    assert m.sent == CROSSING[0] and m.received == CROSSING[2]
    assert "rank 1 -> rank 0, op 0: sent ACT b1 mb0" in m.describe() and "received GRAD b0 mb0" in m.describe()


def test_a_swap_within_a_channel_and_a_missing_receive_are_found_where_they_start():
    swapped = [_op(2, 1, "send", Kind.ACT, 0, mb) for mb in (0, 1, 2)] + \
              [_op(1, 2, "recv", Kind.ACT, 0, mb) for mb in (0, 2, 1)]
    (m,) = mismatches(swapped)
    assert (m.sender, m.receiver, m.channel, m.position) == (2, 1, ("act", 0), 1)
    short = [_op(0, 3, "send", Kind.CONTROL, 9, 0), _op(0, 3, "send", Kind.CONTROL, 9, 1),
             _op(3, 0, "recv", Kind.CONTROL, 9, 0)]
    (m,) = mismatches(short)
    assert m.position == 1 and m.received is None and "received nothing" in m.describe()


def _line(op: PostedOp) -> str:
    return json.dumps({"me": op.me, "peer": op.peer, "op": op.op, "channel": list(op.channel), "tag": op.tag,
                       "numel": op.numel, "dtype": op.dtype, "doing": op.doing})


def test_logs_are_read_back_as_written_and_the_command_says_whether_they_pair(tmp_path, capsys):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(_line(op) + "\n" for op in CROSSING if op.me == rank))
    assert sorted(read_logs(tmp_path), key=repr) == sorted(CROSSING, key=repr)
    assert main([str(tmp_path)]) == 0
    assert main([str(tmp_path), "--per-pair"]) == 1
    assert "rank 1 -> rank 0, op 0" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["not json", "[1]", json.dumps({"me": 0}),
                                  _line(CROSSING[0]).replace('"send"', '"bcast"'),
                                  _line(CROSSING[0]).replace('"me": 1', '"me": true')])
def test_a_malformed_line_is_refused_naming_where_it_is(text):
    with pytest.raises(InvalidInputError, match="rank0.jsonl:3"):
        parse_line(text, where="rank0.jsonl:3")


def test_a_folder_without_logs_is_refused(tmp_path, capsys):
    with pytest.raises(InvalidInputError, match="STAGEWISE_P2P_LOG"):
        read_logs(tmp_path)
    assert main([str(tmp_path)]) == 2 and "error:" in capsys.readouterr().err
