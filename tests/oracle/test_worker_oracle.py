"""The operator oracle with generation workers lost: worker pods (and Gym pods) SIGKILLed
mid-run, one incarnation, weights bit-identical to ``rolloutrun train`` of the same config.

``examples/tiny-grpo.yaml`` in deterministic mode with its generation workers as two Ray
actors on two worker pods (``spec.workers.replicas: 2``, the trainer the Ray head): through
``rolloutrun run`` a worker or Gym pod is deleted with grace 0 (SIGKILL at once, as a node
lost with its pods) every few seconds of training. A lost worker's calls in flight end as
``policy_unreachable`` on the Gyms and are redispatched (attempt + 1) to the surviving
actor; the next refit finds the actor dead and places a replacement on the operator's
replacement worker pod, re-admitted at a later refit. Why the weights cannot depend on
which actor served a call: the Gym's sampling seed depends on (seed, prompt, sibling,
turn) only (never on the attempt or the worker), each call pins the weight version of its
target step, and the engine computes every call on its own (batch-invariant), the same on
every actor. The reference is ``rolloutrun train`` of the same file: the same two actors,
on a private Ray beside the trainer.

Three Ray nodes and the local cluster on a shared machine take minutes: ``make chaos``. The
default suite's proof of the same property is ``tests/runtime/workers/
test_ray_worker_oracle.py`` (a real Ray actor's process SIGKILLed under the controller).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import assert_oracle_holds, run_oracle

WORKER_PODS = 2


@pytest.mark.chaos
@pytest.mark.timeout(3000)
@pytest.mark.parametrize(
    ("roles", "max_steps", "seed", "preemptions"),
    [("worker", 45, 3, 3), ("worker,gym", 60, 4, 5)],
)
def test_workers_lost_mid_run_are_replaced_in_one_incarnation_and_change_no_weight(
    roles: str, max_steps: int, seed: int, preemptions: int, tmp_path: Path
) -> None:
    oracle = run_oracle(
        "tiny-grpo",
        tmp_path,
        max_steps=max_steps,
        preempt_every=3,
        while_training=True,
        max_preemptions=preemptions,
        seed=seed,
        roles=roles,
        worker_pods=WORKER_PODS,
        grace_seconds=0,
        timeout=1500,
    )
    wanted = frozenset(roles.split(","))
    assert_oracle_holds(oracle, max_steps=max_steps, min_preemptions=preemptions, roles=wanted)
    detail = oracle.explain()
    assert oracle.summary["incarnations"] == 1, detail  # only the trainer's loss ends one
    # a deletion may hit a replacement still starting: one replacement then covers both
    assert oracle.summary["member_replacements"]["worker"]["count"] >= 1, detail
