"""The closed protocol between a pool's runner and its ranks, without processes: every message
travels whole, and anything else is a ProtocolError on whichever side receives it."""

from __future__ import annotations

import pickle
from multiprocessing import Pipe

import pytest
import torch

from qgather.errors import HarnessFault
from qgather.runtime import OutcomeStatus, ProtocolError, RankError, same_error_on_every_rank
from qgather.runtime.pool import RankPool, _Rank, _Replies
from qgather.runtime.protocol import (
    RANK_REPLYING,
    RANK_STARTING,
    RUNNER_TO_RANK,
    WHERE_REPLIES,
    HealthCheck,
    Raised,
    Ready,
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
from qgather.runtime.spec import PoolSpec

ERROR = RankError(1, "ValueError", "bad shape", "Traceback ...")


# -- the protocol ---------------------------------------------------------------------------------


@pytest.mark.parametrize("message, family", [
    (RunCase("c1", 3, b"blob"), RUNNER_TO_RANK),
    (HealthCheck(7), RUNNER_TO_RANK),
    (Stop(), RUNNER_TO_RANK),
    (Ready(1234), RANK_STARTING),
    (StartFailed(ERROR), RANK_STARTING),
    (Returned({"t": torch.arange(4)}), RANK_REPLYING),
    (Raised(ERROR), RANK_REPLYING),
    (WhereQuery(), (WhereQuery,)),
    (Whereabouts(("a.py:1 f",), {"all-gather": "8 bytes"}), WHERE_REPLIES),
])
def test_every_message_travels_whole(message, family):
    back = decode(encode(message), family)
    assert type(back) is type(message)
    if isinstance(message, Returned):
        assert torch.equal(back.value["t"], message.value["t"])
    else:
        assert back == message


@pytest.mark.parametrize("stranger", [("ok", None), ("case", "c1", 0, b""), {"frames": []}, "stop", None])
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
