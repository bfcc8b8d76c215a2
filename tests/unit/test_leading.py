"""The operator's leader election settings (`ravnest_operator.leading.election_of`) and a
replica without an election (the Lease itself is exercised against a real apiserver:
tests/integration/test_operator_faults.py)."""

from __future__ import annotations

import pytest

from ravnest_operator.leading import Election, Leadership, election_of


def test_no_lease_named_no_election_and_the_replica_leads():
    assert election_of({}, "host", 7) is None
    assert Leadership(None).leads()


def test_the_election_the_chart_asks_for():
    env = {"RAVNEST_LEADER_ELECTION": "ravnest", "POD_NAMESPACE": "ops", "POD_NAME": "op-7d9"}
    assert election_of(env, "host", 7) == Election("ravnest", "ops", "op-7d9-7", 15, 10, 2)
    assert election_of({**env, "RAVNEST_LEASE_NAMESPACE": "leases",
                        "RAVNEST_LEADER_IDENTITY": "me", "RAVNEST_LEASE_SECONDS": "6",
                        "RAVNEST_RENEW_SECONDS": "4", "RAVNEST_RETRY_SECONDS": "1"},
                       "host", 7) == Election("ravnest", "leases", "me", 6, 4, 1)
    assert election_of({"RAVNEST_LEADER_ELECTION": "x"}, "host", 7) == Election(
        "x", "default", "host-7")


@pytest.mark.parametrize("changes, message", [
    ({"RAVNEST_LEASE_SECONDS": "soon"}, "RAVNEST_LEASE_SECONDS: must be a whole number of "
                                        "seconds, got 'soon'"),
    ({"RAVNEST_RETRY_SECONDS": "0"}, "RAVNEST_RETRY_SECONDS: must be at least 1, got 0"),
    ({"RAVNEST_LEASE_SECONDS": "10"}, "RAVNEST_LEASE_SECONDS (10) must be more than "
                                      "RAVNEST_RENEW_SECONDS (10)"),
    ({"RAVNEST_RENEW_SECONDS": "2"}, "and that more than 1.2 x RAVNEST_RETRY_SECONDS (2)"),
])
def test_an_election_that_cannot_run_stops_the_operator_naming_the_variable(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        election_of({"RAVNEST_LEADER_ELECTION": "x", **changes}, "host", 7)
