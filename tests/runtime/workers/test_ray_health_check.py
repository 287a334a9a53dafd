"""The Ray nodes we start declare a silent node dead within seconds (a deleted worker pod's
actor then fails the refit that called it soon, rather than after Ray's ~15 s), unless the
environment chose its own health-check settings."""

from __future__ import annotations

from rolloutrun_runtime.workers.ray_cluster import HEALTH_CHECK_ENV, node_env


def test_our_nodes_check_health_every_second_and_give_up_after_three_misses() -> None:
    env = node_env({})
    assert env["RAY_health_check_period_ms"] == "1000"
    assert env["RAY_health_check_failure_threshold"] == "3"
    assert all(env[name] == value for name, value in HEALTH_CHECK_ENV.items())


def test_the_environment_keeps_its_own_settings() -> None:
    env = node_env({"RAY_health_check_period_ms": "5000"})
    assert env["RAY_health_check_period_ms"] == "5000"
