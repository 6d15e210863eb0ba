"""Who leads a job's re-plan (jobs/replan.py ``leader_of``): the plan's lowest live member, else the
lowest live standby, so that a plan whose every member died still has a leader."""

from fusionp2p.jobs.replan import leader_of


def test_the_lowest_live_member_of_the_plan_leads() -> None:
    alive = {"b", "c", "a0"}.__contains__
    assert leader_of(["c", "b", "a"], alive, standbys=["a0"]) == "b"    # a standby never outranks a member


def test_when_the_whole_plan_died_the_lowest_live_standby_leads() -> None:
    alive = {"d", "e"}.__contains__
    assert leader_of(["c"], alive, standbys=["a", "c", "e", "d"]) == "d"
    assert leader_of(["c"], alive) is None
    assert leader_of(["c"], lambda _: False, standbys=["d"]) is None
