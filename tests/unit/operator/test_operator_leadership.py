"""Leader election decisions (kvoffload.operator.control.leadership): who may take the operator's Lease."""

from __future__ import annotations

import copy
import datetime
import socket
import threading
import time
import urllib.request
from typing import Any

import pytest

from hack.ports import free_port
from kvoffload import contract as c
from kvoffload.httpreply import MAX_CONNECTIONS
from kvoffload.operator.api.operator_deployment import OperatorDeployment, earlier_install
from kvoffload.operator.control.leadership import (
    LEASE_DURATION_S,
    MICROTIME,
    WEBHOOK_SEAL_PREFIX,
    Leadership,
    Publication,
    holders_inputs,
    holders_publication,
    keep_renewing,
    lease_body,
    lease_state,
    planning_seal_key,
    sealed,
    serve_health_while_waiting,
    still_held,
)

pytestmark = pytest.mark.operator
NOW = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


def held_by(holder: str, seconds_ago: float) -> dict[str, object]:
    renewed = (NOW - datetime.timedelta(seconds=seconds_ago)).strftime(MICROTIME)
    return {"metadata": {"resourceVersion": "7"},
            "spec": {"holderIdentity": holder, "renewTime": renewed, "leaseDurationSeconds": LEASE_DURATION_S}}  # fmt: skip


@pytest.mark.parametrize(
    ("lease", "state"),
    [
        (None, "free"),
        ({"spec": {"holderIdentity": ""}}, "free"),  # released by a stopping operator
        (held_by("old-pod", 3), "held"),
        (held_by("old-pod", LEASE_DURATION_S - 1), "held"),
        (held_by("old-pod", LEASE_DURATION_S + 1), "free"),  # its holder died without releasing
        (held_by("me", 3), "ours"),  # the same pod after a container restart
        ({"spec": {"holderIdentity": "old-pod"}}, "free"),  # no time at all: nobody renews it
    ],
)
def test_who_may_take_the_lease(lease: dict[str, object] | None, state: str) -> None:
    assert lease_state(lease, "me", NOW) == state


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time() -> None:
    taken = lease_body("kvoffload-operator", "ns", "me", NOW, held_by("old-pod", 60))
    assert taken["spec"]["holderIdentity"] == "me" and taken["spec"]["leaseTransitions"] == 1
    assert taken["metadata"]["resourceVersion"] == "7"  # optimistic: a concurrent taker gets 409
    later = NOW + datetime.timedelta(seconds=5)
    renewed = lease_body("kvoffload-operator", "ns", "me", later, taken)
    assert renewed["spec"]["acquireTime"] == taken["spec"]["acquireTime"]
    assert renewed["spec"]["renewTime"] == later.strftime(MICROTIME) and renewed["spec"]["leaseTransitions"] == 1
    first = lease_body("kvoffload-operator", "ns", "me", NOW, None)
    assert first["spec"]["leaseTransitions"] == 0 and "resourceVersion" not in first["metadata"]


def test_a_refusal_right_after_an_apiserver_outage_longer_than_the_lease_term_is_retried() -> None:
    """Seen in CI: the apiserver was down 11 s, then its RBAC cache refused the renewal (403) 16 s
    after the last one; counting from the last renewal, the operator gave up the moment it answered."""
    assert keep_renewing(0, None, NOW), "unreachable: nobody can take the Lease through it"
    assert keep_renewing(503, None, NOW)
    assert keep_renewing(403, NOW, NOW), "the first refusal after the outage"
    later = NOW + datetime.timedelta(seconds=LEASE_DURATION_S - 1)
    assert keep_renewing(403, NOW, later)
    assert not keep_renewing(403, NOW, NOW + datetime.timedelta(seconds=LEASE_DURATION_S)), (
        "rights really taken away end it after one term of refusals"
    )


def test_the_uninstall_hooks_long_hold_keeps_operators_waiting_until_it_runs_out() -> None:
    """The hook seizes the Lease for a long term (``lease_body(duration_s=...)``): an operator that
    restarts or a standby finds it held for that term, not just for a normal one."""
    seized = lease_body("kvoffload-operator", "ns", "kvoffload-uninstall", NOW, held_by("old-pod", 1), 120)
    later = NOW + datetime.timedelta(seconds=LEASE_DURATION_S + 30)
    assert lease_state(seized, "old-pod", later) == "held"
    assert lease_state(seized, "old-pod", NOW + datetime.timedelta(seconds=121)) == "free"


def test_the_lease_names_the_operators_deployment_and_a_reinstall_takes_over_an_earlier_installs() -> None:
    """The Lease is owned by the operator's Deployment (the garbage collector deletes it with it); a
    write keeps its other owners and replaces an earlier install's Deployment with this one's."""
    old, new = (
        OperatorDeployment("kvo-kvoffload-operator", "uid-old"),
        OperatorDeployment("kvo-kvoffload-operator", "uid-new"),
    )
    seized = lease_body("kvoffload-operator", "ns", "kvoffload-uninstall", NOW, held_by("old-pod", 1), 120, old)
    assert seized["metadata"]["ownerReferences"] == [old.reference()]
    assert lease_body("l", "ns", "me", NOW, seized)["metadata"]["ownerReferences"] == [old.reference()], "kept"
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}
    seized["metadata"]["ownerReferences"] = [other, old.reference()]
    taken = lease_body("kvoffload-operator", "ns", "new-pod", NOW, seized, owner=new)
    assert taken["metadata"]["ownerReferences"] == [other, new.reference()]
    # the hook's long hold counts only while its Deployment is there
    assert lease_state(seized, "new-pod", NOW + datetime.timedelta(seconds=30)) == "held"
    assert lease_state(seized, "new-pod", NOW + datetime.timedelta(seconds=30), owner_gone=True) == "free"


class Deployments:
    """The slice of ``Kube`` ``earlier_install`` reads: the Deployments of one namespace by name."""

    def __init__(self, **uids: str) -> None:
        self.uids = uids
        self.reads = 0

    def get(self, path: str) -> dict[str, object] | None:
        self.reads += 1
        uid = self.uids.get(path.rsplit("/", 1)[-1])
        return {"metadata": {"uid": uid}} if uid else None


def test_a_lease_is_an_earlier_installs_only_when_its_deployment_is_gone() -> None:
    old, new = (
        OperatorDeployment("kvo-kvoffload-operator", "uid-old"),
        OperatorDeployment("kvo-kvoffload-operator", "uid-new"),
    )
    lease = {"metadata": {"ownerReferences": [old.reference()]}}
    reinstalled = Deployments(**{"kvo-kvoffload-operator": "uid-new"})
    assert earlier_install(reinstalled, "ns", lease, new)  # type: ignore[arg-type]
    assert earlier_install(Deployments(), "ns", lease, new)  # type: ignore[arg-type]
    # the old Deployment's pod, still stopping, finds the new install's Lease: still there, it waits
    new_lease = {"metadata": {"ownerReferences": [new.reference()]}}
    assert not earlier_install(reinstalled, "ns", new_lease, old)  # type: ignore[arg-type]
    ours = Deployments()
    assert not earlier_install(ours, "ns", lease, old) and ours.reads == 0, "its own: no read"  # type: ignore[arg-type]
    assert not earlier_install(ours, "ns", {"metadata": {}}, new)  # type: ignore[arg-type]
    assert not earlier_install(ours, "ns", lease, None)  # type: ignore[arg-type]


def test_a_standby_answers_its_liveness_probe_behind_idle_connections_with_bounded_threads() -> None:
    port = free_port()
    before = threading.active_count()
    with serve_health_while_waiting(port):
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3 * MAX_CONNECTIONS)]
        try:
            time.sleep(0.3)
            assert threading.active_count() - before <= MAX_CONNECTIONS + 2  # + the accept loop and the reaper
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as reply:
                assert reply.status == 200
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize(
    ("renewed_ago", "stopped", "held"),
    [
        (None, False, False),  # never took it (a standby)
        (1.0, False, True),
        (LEASE_DURATION_S - 0.5, False, True),  # renewals failing, the term still running
        (LEASE_DURATION_S + 0.5, False, False),  # its term is over: another may hold it now
        (1.0, True, False),  # released (stopping) or lost
    ],
)
def test_a_holder_acts_as_one_only_within_its_term_and_until_it_stops(
    renewed_ago: float | None, stopped: bool, held: bool
) -> None:
    now = 1000.0
    assert still_held(None if renewed_ago is None else now - renewed_ago, now, stopped) is held


class LeaseStore:
    """The slice of ``Kube`` ``Leadership`` uses: one Lease, created, read and replaced."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None

    def get(self, _path: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    def create(self, _path: str, body: dict[str, Any]) -> None:
        self.lease = copy.deepcopy(body)

    def request(self, _method: str, _path: str, body: dict[str, Any]) -> None:
        self.lease = copy.deepcopy(body)


def test_a_process_holds_the_lease_from_taking_it_until_it_releases_it() -> None:
    store = LeaseStore()
    leadership = Leadership(store, "ns", "kvoffload-operator", "me")  # type: ignore[arg-type]
    assert not leadership.holds_lease()
    assert leadership.acquire(threading.Event())
    assert leadership.holds_lease()
    leadership.release()
    assert not leadership.holds_lease() and not (store.lease or {})["spec"]["holderIdentity"]
    other = Leadership(store, "ns", "kvoffload-operator", "other")  # type: ignore[arg-type]
    store.lease = lease_body("kvoffload-operator", "ns", "me", datetime.datetime.now(datetime.timezone.utc), None)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()  # after its first attempt found the Lease held
    assert not other.acquire(stop) and not other.holds_lease(), "a standby waiting for a held Lease plans nothing"


def test_the_holder_publishes_its_planning_inputs_and_the_uninstall_hook_takes_them_away() -> None:
    held = lease_body("kvoffload-operator", "ns", "old-pod", NOW, None, planning="inputs-a")
    assert held["metadata"]["annotations"] == {c.ANN_LEASE_PLANNING: "inputs-a"}
    taken = lease_body("kvoffload-operator", "ns", "new-pod", NOW, held, planning="inputs-b")
    assert taken["metadata"]["annotations"] == {c.ANN_LEASE_PLANNING: "inputs-b"}
    seized = lease_body("kvoffload-operator", "ns", "kvoffload-uninstall", NOW, taken, 120)
    assert c.ANN_LEASE_PLANNING not in (seized["metadata"].get("annotations") or {})


def published(holder: str, seconds_ago: float, planning: str) -> dict[str, Any]:
    lease = held_by(holder, seconds_ago)
    lease["metadata"]["annotations"] = {c.ANN_LEASE_PLANNING: planning}  # type: ignore[index]
    return lease


KEY = planning_seal_key(b"-----BEGIN PRIVATE KEY----- the webhook's serving key")
THEIRS = sealed("theirs", KEY)


@pytest.mark.parametrize(
    ("lease", "inputs"),
    [
        (published("leader", 3, THEIRS), "theirs"),  # a running holder: a standby or an upgrade's new pod plans so
        (held_by("leader", 3), None),  # a holder that publishes none (an earlier version, the uninstall hook)
        (published("leader", LEASE_DURATION_S + 1, THEIRS), None),  # nobody holds it now
        ({"spec": {"holderIdentity": ""}, "metadata": {"annotations": {c.ANN_LEASE_PLANNING: THEIRS}}}, None),
        (None, None),
    ],
)
def test_a_replica_without_the_lease_plans_with_the_inputs_a_running_holder_published(
    lease: dict[str, Any] | None, inputs: str | None
) -> None:
    assert holders_inputs(lease, "me", NOW, KEY) == inputs


@pytest.mark.parametrize(
    "forged",
    [
        "theirs",  # unsealed (a digest or inputs of an earlier version, or written by hand)
        sealed("theirs", planning_seal_key(b"another install's serving key")),
        THEIRS.replace("theirs", "mine"),  # sealed inputs edited
        THEIRS + "0",
        "\n" + THEIRS.rpartition("\n")[2],
    ],
)
def test_inputs_in_the_lease_that_are_not_sealed_with_the_webhooks_key_are_never_planned_with(forged: str) -> None:
    """A writer of the Lease who cannot read the webhook's Secret cannot make the replicas plan with
    inputs of its own (images, sizes): they make no plan."""
    assert holders_inputs(published("leader", 3, forged), "me", NOW, KEY) is None


def test_every_replica_plans_with_the_holders_inputs_and_with_the_next_holders_once_it_takes_over() -> None:
    store = LeaseStore()
    leader = Leadership(store, "ns", "kvoffload-operator", "leader", planning="v1")  # type: ignore[arg-type]
    standby = Leadership(store, "ns", "kvoffload-operator", "standby", planning="v1")  # type: ignore[arg-type]
    upgraded = Leadership(store, "ns", "kvoffload-operator", "upgraded", planning="v2")  # type: ignore[arg-type]
    assert standby.holders_inputs() is None, "nobody holds the Lease"
    assert leader.acquire(threading.Event()) and leader.holders_inputs() == "v1"
    assert standby.holders_inputs() == "v1" and upgraded.holders_inputs() == "v1"
    leader.release()
    assert leader.holders_inputs() is None and standby.holders_inputs() is None, "released: nobody plans until taken"
    assert upgraded.acquire(threading.Event()) and upgraded.holders_inputs() == "v2"
    assert standby.holders_inputs() == "v2" and leader.holders_inputs() == "v2"


def test_the_holder_publishes_its_webhooks_address_sealed_and_a_planning_seal_never_reads_as_one() -> None:
    """A replica of another version forwards reviews to the address the holder published: only one
    sealed as an address under the install's key is read; the uninstall hook's seizure takes it away."""
    address = sealed(WEBHOOK_SEAL_PREFIX + "10.0.0.7:8443", KEY)
    held = lease_body("kvoffload-operator", "ns", "leader", NOW - datetime.timedelta(seconds=3), None,
                      planning=THEIRS, webhook=address)  # fmt: skip
    assert holders_publication(held, "me", NOW, KEY) == Publication("theirs", "10.0.0.7:8443")
    assert holders_publication(held, "leader", NOW, KEY) == Publication(), "its own Lease: nothing to forward to"
    for forged in (
        "10.0.0.7:8443",
        sealed("10.6.6.6:8443", KEY),
        THEIRS,
        sealed(WEBHOOK_SEAL_PREFIX + "10.6.6.6:8443", planning_seal_key(b"another install's key")),
    ):
        lease = copy.deepcopy(held)
        lease["metadata"]["annotations"][c.ANN_LEASE_WEBHOOK] = forged
        assert holders_publication(lease, "me", NOW, KEY).webhook is None, forged
    seized = lease_body("kvoffload-operator", "ns", "kvoffload-uninstall", NOW, held, 120)
    assert not set(seized["metadata"].get("annotations") or {}) & {c.ANN_LEASE_PLANNING, c.ANN_LEASE_WEBHOOK}


def test_a_holder_publishes_where_its_webhook_listens_and_the_others_read_it_while_it_holds() -> None:
    store = LeaseStore()
    leader = Leadership(store, "ns", "kvoffload-operator", "leader", planning="v1", seal_key=KEY,  # type: ignore[arg-type]
                        webhook_address="10.0.0.7:8443")  # fmt: skip
    upgraded = Leadership(store, "ns", "kvoffload-operator", "upgraded", planning="v2", seal_key=KEY)  # type: ignore[arg-type]
    assert upgraded.others_publication() == Publication()
    assert leader.acquire(threading.Event())
    assert upgraded.others_publication() == Publication("v1", "10.0.0.7:8443")
    assert leader.others_publication() == Publication(), "the holder forwards nothing"
    leader.release()
    assert upgraded.others_publication() == Publication()
