"""The closed protocol between a pool's runner and its ranks, without processes: every message
travels whole, anything else is a ProtocolError on whichever side receives it, and a launched
job's reports merge into one outcome."""

from __future__ import annotations

import pickle
from multiprocessing import Pipe

import pytest
import torch

from qgather.errors import HarnessFault
from qgather.runtime import OutcomeStatus, ProtocolError, RankError, same_error_on_every_rank
from qgather.runtime.external import _merge
from qgather.runtime.pool import RankPool, _Rank
from qgather.runtime.protocol import (
    JOB_REPORTS,
    RANK_REPLYING,
    RANK_STARTING,
    RUNNER_TO_RANK,
    WHERE_REPLIES,
    HealthCheck,
    HeldWait,
    Raised,
    RankReport,
    Ready,
    Release,
    ReportState,
    Returned,
    RunCase,
    StartFailed,
    Stop,
    UnreadableMessage,
    Whereabouts,
    WhereQuery,
    decode,
    decode_case,
    encode,
    encode_case,
)
from qgather.runtime.rank import _serve
from qgather.runtime.replies import Replies as _Replies
from qgather.runtime.spec import PoolSpec

ERROR = RankError(1, "ValueError", "bad shape", "Traceback ...")


# -- the protocol ---------------------------------------------------------------------------------


@pytest.mark.parametrize("message, family", [
    (RunCase("c1", 3, b"blob"), RUNNER_TO_RANK),
    (HealthCheck(7), RUNNER_TO_RANK),
    (Stop(), RUNNER_TO_RANK),
    (Release((HeldWait((0, 1), 3), HeldWait((2, 3), 0))), RUNNER_TO_RANK),
    (Ready(1234), RANK_STARTING),
    (StartFailed(ERROR), RANK_STARTING),
    (Returned({"t": torch.arange(4)}), RANK_REPLYING),
    (Raised(ERROR), RANK_REPLYING),
    (WhereQuery(), (WhereQuery,)),
    (Whereabouts(("a.py:1 f",), {"all-gather": "8 bytes"}), WHERE_REPLIES),
    (Whereabouts(("agreement.py:1 _wait_for_members",), {}, HeldWait((0, 1), 2)), WHERE_REPLIES),
    (RankReport(ReportState.HANG, 2, "host", 1.5, stacks="Thread 0x1"), JOB_REPORTS),
])
def test_every_message_travels_whole(message, family):
    back = decode(encode(message), family)
    assert type(back) is type(message)
    if isinstance(message, Returned):
        assert torch.equal(back.value["t"], message.value["t"])
    else:
        assert back == message


@pytest.mark.parametrize("stranger", [("ok", None), ("case", "c1", 0, b""), {"state": "done"}, "stop", None])
def test_anything_outside_the_closed_set_is_a_protocol_error(stranger):
    data = pickle.dumps(stranger)
    with pytest.raises(ProtocolError, match="expected RunCase | HealthCheck | Stop"):
        decode(data, RUNNER_TO_RANK)
    with pytest.raises(ProtocolError, match="not a runtime protocol message"):
        encode(stranger)
    assert issubclass(ProtocolError, HarnessFault)


def test_a_message_of_another_channel_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="expected Returned | Raised, got Ready"):
        decode(encode(Ready(1)), RANK_REPLYING)
    with pytest.raises(ProtocolError, match="got RunCase"):
        decode(encode(RunCase("c", 0, b"")), RANK_STARTING)


def test_bytes_that_do_not_unpickle_are_unreadable_with_their_cause():
    with pytest.raises(UnreadableMessage) as info:
        decode(b"not a pickle", RANK_REPLYING)
    assert isinstance(info.value, ProtocolError) and isinstance(info.value.cause, pickle.UnpicklingError)


def test_a_case_travels_as_a_blob():
    fn, args = decode_case(encode_case(same_error_on_every_rank, ({}, 2)))
    assert fn is same_error_on_every_rank and args == ({}, 2)
    with pytest.raises(TypeError, match="fn must be a module-level function"):
        encode_case("not callable", ())


def test_a_rank_raises_on_a_message_it_does_not_serve():
    runner, rank = Pipe()
    runner.send_bytes(encode(Ready(1)))  # a rank -> runner message, sent the wrong way
    with pytest.raises(ProtocolError, match="got Ready"):
        _serve(None, rank)
    runner.send_bytes(pickle.dumps(("stop",)))  # the old tagged tuples are not messages any more
    with pytest.raises(ProtocolError, match="got tuple"):
        _serve(None, rank)


def test_the_pool_raises_on_a_reply_it_cannot_file():
    pool = RankPool(PoolSpec("gloo", 2, "cpu"))  # never started: _record needs no process
    r = _Rank(1, process=None, conn=None)
    replies = _Replies(2, RANK_REPLYING)
    with pytest.raises(ProtocolError, match="got Ready"):
        pool._record(r, encode(Ready(99)), replies)
    with pytest.raises(ProtocolError, match="got StartFailed"):
        pool._record(r, encode(StartFailed(ERROR)), _Replies(2, RANK_REPLYING))
    filed = _Replies(2, RANK_REPLYING)
    pool._record(r, encode(Raised(ERROR)), filed)
    pool._record(_Rank(0, process=None, conn=None), encode(Returned([0, 1])), filed)
    assert filed.errors == {1: ERROR} and filed.results == [[0, 1], None] and filed.status is OutcomeStatus.ERROR
    unreadable = _Replies(2, RANK_REPLYING)
    pool._record(r, b"not a pickle", unreadable)  # e.g. a result class the parent cannot import
    assert "the parent could not unpickle this rank's reply" in unreadable.errors[1].message


# -- a launched job's reports ---------------------------------------------------------------------


def _report(rank: int, state: ReportState, **fields) -> RankReport:
    return RankReport(state, rank, f"host{rank}", 0.5, **fields)


def test_job_reports_merge_into_one_outcome():
    members, hosts = (0, 2), ["host0", "host1", "host2"]
    ok = _merge({0: _report(0, ReportState.DONE, result=0), 1: _report(1, ReportState.IDLE),
                 2: _report(2, ReportState.DONE, result=1)}, members, "cross-node", hosts, "c")
    assert (ok.status, ok.results, ok.job_ranks, ok.hosts) == (OutcomeStatus.OK, [0, 1], (0, 2), ("host0", "host2"))
    hang = _merge({0: _report(0, ReportState.HANG, stacks="s0"), 2: _report(2, ReportState.WAITING, stacks="s2")},
                  members, "cross-node", hosts, "c")
    assert (hang.status, hang.stacks, hang.unfinished) == (OutcomeStatus.HANG, {0: "s0", 1: "s2"}, (0, 1))
    lost = _merge({0: _report(0, ReportState.WAITING, stacks="s0")}, members, "cross-node", hosts, "c")
    assert lost.status is OutcomeStatus.CRASH and lost.stacks == {0: "s0"}
    assert "rank 1 (job rank 2 on host2) sent no report" in lost.headline()
    raised = _merge({0: _report(0, ReportState.DONE, error=ERROR), 2: _report(2, ReportState.DONE, result=1)},
                    members, "cross-node", hosts, "c")
    assert raised.status is OutcomeStatus.ERROR and raised.errors == {0: ERROR}
    with pytest.raises(ProtocolError, match="a member of case 'c', reported idle"):
        _merge({0: _report(0, ReportState.IDLE), 2: _report(2, ReportState.DONE)}, members, "cross-node", hosts, "c")
