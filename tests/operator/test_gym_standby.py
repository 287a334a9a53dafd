"""``spec.gym.standby``: warm standby Gym pods beyond ``spec.gym.replicas``. The operator
keeps them like the others (created at launch under the next indices, a lost one replaced
under its index and counted as a Gym replacement), and the trainer's config names every
Gym's endpoint with how many are active (``gym.replicas``) and standing by
(``gym.standby``). Which serve is the trainer's decision (``gym_client.pick_replica``)."""

from __future__ import annotations

import pytest

from rolloutrun_operator import builders, kueue, naming
from rolloutrun_operator.api.validation import RolloutRunInvalid
from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import NOW, gym, make_run, observed, running_status, trainer


def _run(status=None, standby=1):
    return make_run(status, gym={"standby": standby})


def test_the_standby_gyms_are_created_at_launch_under_the_next_indices():
    first = reconcile(_run(), observed(), NOW)
    created = [str(a) for a in first.actions if str(a).startswith("create Pod/")]
    assert created == [f"create Pod/demo-i1-gym-{i}" for i in range(3)]
    status = first.status.model_dump(by_alias=True, mode="json")
    two = reconcile(_run(status), observed((gym(1, 0), gym(1, 1))), NOW)
    assert "create Pod/demo-i1-trainer" not in [str(a) for a in two.actions]  # waits for 2
    three = reconcile(_run(status), observed((gym(1, 0), gym(1, 1), gym(1, 2))), NOW)
    assert "create Pod/demo-i1-trainer" in [str(a) for a in three.actions]


def test_the_trainers_config_names_every_endpoint_and_the_active_count():
    urls = [f"http://127.0.0.{10 + i}:8000" for i in range(3)]
    config = builders.render_run_config(_run(), urls)
    assert (config.gym.replicas, config.gym.standby, config.gym.servers) == (2, 1, 3)
    assert config.gym.endpoints == urls
    data = builders.config_data(_run(), urls, None)
    assert "standby: 1" in data[naming.CONFIG_KEY]
    # without standbys the field is not written: a runtime older than it refuses it
    plain = builders.config_data(make_run(), urls[:2], None)
    assert "standby" not in plain[naming.CONFIG_KEY]
    assert "standby" not in plain[naming.GYM_CONFIG_KEY]


def test_a_lost_standby_gym_is_replaced_under_its_index_as_a_gym():
    pods = (trainer(1), gym(1, 0), gym(1, 1))
    lost = reconcile(_run(running_status()), observed(pods), NOW)
    assert [str(a) for a in lost.actions] == ["create Pod/demo-i1-gym-2"]
    assert lost.actions[0].manifest["metadata"]["labels"][naming.LABEL_GYM_INDEX] == "2"
    [member] = lost.status.members
    assert (member.role, member.index, member.generation) == ("gym", 2, 1)
    assert lost.status.incarnation == 1  # the incarnation goes on


def test_a_lost_active_gym_with_a_standby_is_replaced_and_the_incarnation_goes_on():
    pods = (trainer(1), gym(1, 1), gym(1, 2))
    lost = reconcile(_run(running_status()), observed(pods), NOW)
    assert [str(a) for a in lost.actions] == ["create Pod/demo-i1-gym-0"]
    assert lost.status.incarnation == 1


def test_kueue_counts_the_standby_gyms_in_the_gym_pod_set():
    workload = kueue.workload_manifest(_run(), "queue")
    gyms = next(s for s in workload["spec"]["podSets"] if s["name"] == kueue.GYM_POD_SET)
    assert gyms["count"] == 3


@pytest.mark.parametrize("standby", [-1, 65])
def test_standby_is_bounded(standby):
    with pytest.raises(RolloutRunInvalid, match="standby"):
        _run(standby=standby)


def test_standby_defaults_to_none():
    run = make_run()
    assert (run.spec.gym.standby, run.spec.gym.pods) == (0, 2)
    assert builders.render_run_config(run).gym.standby == 0


def test_the_crd_documents_and_bounds_the_field():
    from rolloutrun_operator.api import crdgen

    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["gym"]["properties"]["standby"]
    assert (field["type"], field["minimum"], field["maximum"], field["default"]) == (
        "integer",
        0,
        64,
        0,
    )
    assert "idle Gym pod" in field["description"]
