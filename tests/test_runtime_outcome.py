"""What a case run returns, without processes: the outcome's closed status, its headline, "the same
error on every rank" decided in one place, and exception classes matched by class, not by name."""

from __future__ import annotations

import json

import pytest

from qgather.errors import HarnessFault, Refusal
from qgather.runtime import CaseOutcome, OutcomeStatus, RankError, same_error_on_every_rank

# -- the outcome's status -------------------------------------------------------------------------


def test_status_is_a_closed_enum_that_still_compares_as_a_string():
    assert [s.value for s in OutcomeStatus] == ["ok", "error", "hang", "crash"]
    assert OutcomeStatus.OK == "ok" and f"{OutcomeStatus.HANG}" == "hang" and str(OutcomeStatus.CRASH) == "crash"
    assert json.dumps({"status": OutcomeStatus.ERROR}) == '{"status": "error"}'
    for member in OutcomeStatus:
        assert f"``{member.name}``" in OutcomeStatus.__doc__  # a line of documentation per member
    outcome = CaseOutcome("hang", [None, None], unfinished=(0, 1))
    assert outcome.status is OutcomeStatus.HANG and not outcome.ok
    with pytest.raises(ValueError, match="'finished' is not a valid OutcomeStatus"):
        CaseOutcome("finished", [None])
    with pytest.raises(AttributeError):
        outcome.status = OutcomeStatus.OK  # built once: frozen


def test_headline_is_the_first_line_of_the_summary():
    every = {r: RankError(r, "ValueError", "bad dtype\nsecond line") for r in range(2)}
    outcomes = [
        CaseOutcome("ok", [1, 2], duration_s=0.001),
        CaseOutcome("error", [None] * 2, errors=every),
        CaseOutcome("hang", [None] * 2, duration_s=5.0, unfinished=(0, 1), note="see\nbelow"),
        CaseOutcome("crash", [None] * 2, exit_codes={1: -9}),
    ]
    for outcome in outcomes:
        assert outcome.headline() == outcome.summary().splitlines()[0]
        assert "\n" not in outcome.headline()
    assert outcomes[1].headline() == "every rank raised ValueError: bad dtype"
    assert outcomes[3].headline() == "CRASH: rank 1 killed by SIGKILL"


# -- the same error on every rank -----------------------------------------------------------------


def _errors(*messages: str, type_name: str = "ValueError") -> dict[int, RankError]:
    return {rank: RankError(rank, type_name, message) for rank, message in enumerate(messages)}


def test_the_same_error_on_every_rank_is_the_lowest_ranks():
    errors = _errors("shard of 34 rows is not a multiple of 16", "shard of 30 rows is not a multiple of 16")
    assert same_error_on_every_rank(errors, 2) is errors[0]  # up to numbers: each rank names its own shard
    reordered = {1: errors[1], 0: errors[0]}
    assert same_error_on_every_rank(reordered, 2) is errors[0]
    assert CaseOutcome("error", [None, None], errors=errors).summary() == \
        "every rank raised ValueError: shard of 34 rows is not a multiple of 16"


@pytest.mark.parametrize("errors, world_size", [
    (_errors("bad"), 2),                                   # rank 1 did not raise
    (_errors("bad", "bad"), 3),
    (_errors("bad", "worse"), 2),                          # another first line
    ({0: RankError(0, "ValueError", "bad"), 1: RankError(1, "TypeError", "bad")}, 2),
    ({0: RankError(0, "E", "bad", type_qualnames=("a.E",)), 1: RankError(1, "E", "bad", type_qualnames=("b.E",))}, 2),
    ({}, 0),
])
def test_anything_else_is_not_the_same_error(errors, world_size):
    assert same_error_on_every_rank(errors, world_size) is None


# -- exception classes, matched by class ----------------------------------------------------------


class ShardRefusal(Refusal):
    """A refusal declared by some adapter."""


class ValueErrorLookalike(Exception):
    """Not a ValueError, whatever its name says."""


ValueErrorLookalike.__name__ = ValueErrorLookalike.__qualname__ = "ValueError"


def test_a_rank_error_names_every_class_of_the_exception():
    try:
        raise ShardRefusal("136 rows do not split into 16-row blocks")
    except ShardRefusal as exc:
        error = RankError.from_exception(0, exc)
    assert error.type_names[:2] == ("ShardRefusal", "Refusal")
    assert error.type_qualnames[:4] == (f"{__name__}.ShardRefusal", "qgather.errors.Refusal",
                                        "qgather.errors.QgatherError", "builtins.ValueError")
    assert len(error.type_qualnames) == len(error.type_names)
    assert error.instance_of(ShardRefusal) and error.instance_of(Refusal) and error.instance_of(ValueError)
    assert not error.instance_of(HarnessFault)
    lookalike = RankError.from_exception(0, ValueErrorLookalike("bad"))
    assert lookalike.type_name == "ValueError" and not lookalike.instance_of(ValueError)


def test_alike_exceptions_of_many_ranks_share_one_formatted_record():
    from qgather.runtime.outcome import RankError

    def refuse(message: str) -> BaseException:
        try:
            raise ValueError(message)
        except ValueError as exc:
            exc.qgather_seconds = (("shard", float(len(message))),)
            return exc

    results = [refuse("shard 1 of 136"), refuse("shard 1 of 136"), "a result", refuse("shard 2 of 136")]
    errors = RankError.from_exceptions(results)
    assert sorted(errors) == [0, 1, 3]
    assert [errors[r].rank for r in (0, 1, 3)] == [0, 1, 3]
    assert errors[0].traceback_text is errors[1].traceback_text  # formatted once
    assert errors[0] == RankError.from_exception(0, results[0])
    assert errors[1] == RankError.from_exception(1, results[1])
    assert errors[3].message == "shard 2 of 136" and "shard 2 of 136" in errors[3].traceback_text


def test_an_exception_chain_that_is_a_cycle_is_still_recorded():
    """A cause that is its own context's cause (a cycle, which traceback's formatting tolerates)
    gives a rank error, not a RecursionError in the runner."""
    first, second = ValueError("shard 1"), RuntimeError("wrapped")
    first.__context__, second.__cause__ = second, first
    errors = RankError.from_exceptions([first, first])
    assert sorted(errors) == [0, 1] and errors[0].message == "shard 1"
