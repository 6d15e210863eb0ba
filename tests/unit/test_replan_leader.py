"""Who leads a job's re-plan (jobs/replan.py ``leader_of``): the plan's lowest live member, else the
lowest live standby, so that a plan whose every member died still has a leader."""

import pytest

from fusionp2p.jobs.replan import announcer, leader_of, still_taking_off


def test_the_lowest_live_member_of_the_plan_leads() -> None:
    alive = {"b", "c", "a0"}.__contains__
    assert leader_of(["c", "b", "a"], alive, standbys=["a0"]) == "b"    # a standby never outranks a member


def test_when_the_whole_plan_died_the_lowest_live_standby_leads() -> None:
    alive = {"d", "e"}.__contains__
    assert leader_of(["c"], alive, standbys=["a", "c", "e", "d"]) == "d"
    assert leader_of(["c"], alive) is None
    assert leader_of(["c"], lambda _: False, standbys=["d"]) is None


# announcer: who tells the publisher of an epoch's plan (issue 41: a plan of joiners only never reached it)
@pytest.mark.parametrize(("members", "previous", "who"), [
    (["j1", "j2", "b", "a"], ["a", "x"], "a"),    # the survivor standing by, not the lowest joiner with a role
    (["j1", "b", "c"], ["c", "b"], "b"),          # the lowest of the previous plan's members
    (["j1", "j2"], ["x"], "j1"),                  # no one of the previous plan is left: the lowest member
    (["c", "b"], None, "b"),                      # the first epoch: the lowest member
])
def test_the_announcer_is_a_member_the_publisher_heard_of(members: list[str], previous: list[str] | None,
                                                          who: str) -> None:
    assert announcer(members, previous) == who


def test_an_epoch_without_members_has_no_announcer() -> None:
    with pytest.raises(ValueError, match="no announcer"):
        announcer([], ["a"])


# still_taking_off: the leader's guard over the epoch it proposed (issue 41: it delayed a second kill's re-plan)
_YOUNG = {"proposed": True, "since": 3.0, "retry": 20.0, "stalled": False, "broken": True, "fresh": False,
          "gone": False, "trained": False, "reported": False}


@pytest.mark.parametrize(("change", "waits"), [
    ({}, True),                                   # broken while taking off: its members may still be setting up
    ({"stalled": True, "broken": False}, True),
    ({"since": 20.0}, False),                     # older than replan_retry: propose again
    ({"proposed": False}, False),                 # an epoch this node did not propose: nothing to wait for
    ({"broken": False}, False),                   # nothing wrong (the guard only holds back a re-plan)
    ({"stalled": True, "broken": False, "fresh": True}, False),   # a newcomer accepted: take it in now
    ({"fresh": True}, True),                      # newcomers alone do not cut a broken take-off short
    ({"gone": True}, False),                      # a member of the proposed plan died: it cannot take off
    ({"trained": True}, False),                   # it trained a step, then broke: a new failure
    ({"reported": True}, False),                  # a member's own run of the epoch ended (a failed state fetch)
])
def test_the_leader_waits_only_for_a_young_epoch_that_has_not_trained_and_lost_no_member(
        change: dict[str, object], waits: bool) -> None:
    assert still_taking_off(**{**_YOUNG, **change}) is waits   # type: ignore[arg-type]
