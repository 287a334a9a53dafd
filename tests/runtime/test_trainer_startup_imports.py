"""The trainer pod's start-up imports only what it runs: the dispatcher loads only the chosen
command, so ``rolloutrun trainer`` never imports the operator, the local cluster, kopf or Ray
(with the in-process worker backend), each of which costs start-up time before the first
redispatch after a resume. And it imports torch with the cyclic GC off (its passes over the
growing heap cost 10-20 % of the imports), back on once the imports are frozen."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from rolloutrun_runtime import cli
from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN, ENV_LEASE_NAME, ENV_POD_NAMESPACE

FORBIDDEN = ("rolloutrun_operator", "rolloutrun_localcluster", "kopf", "ray")
#: Not imported by the trainer before its first redispatch in a run that does not use them:
#: a Hugging Face policy's libraries (the built-in policy needs none), the kubernetes client
#: (the Lease keeper's process holds the Lease), the Prometheus client (``/metrics`` is
#: served by hand), and ``statistics`` (~10 ms, for one mean in the trace's report).
UNUSED_AT_START = (
    "transformers",
    "safetensors",
    "huggingface_hub",
    "kubernetes",
    "prometheus_client",
    "statistics",
)

_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    from rolloutrun_runtime.cli import main

    seen = {{}}

    def audit(event, args):
        if event == "import" and args[0] == "torch" and "torch" not in seen:
            seen["torch"] = gc.isenabled()  # whether the cyclic GC was on then
        if event == "subprocess.Popen" and "rolloutrun_runtime.lease_keeper" in args[1]:
            seen["keeper"] = {{  # the Lease keeper, started: torch yet? the Gym token?
                "torch": "torch" in sys.modules,
                "token": any("gym-secret" in str(v) for v in (args[3] or {{}}).values()),
            }}

    sys.addaudithook(audit)
    code = main(["trainer", "--config", sys.argv[1]])
    # what run_trainer imports once the config is read (in-process workers, a restore)
    import rolloutrun_runtime.trainer
    import rolloutrun_runtime.algorithms.single_controller
    import rolloutrun_runtime.algorithms.rollout_checkpointing.restore
    import rolloutrun_runtime.workers.inprocess
    import rolloutrun_runtime.coordination
    import rolloutrun_runtime.algorithms.rollout_checkpointing.trace
    import rolloutrun_runtime.algorithms.optimizer
    import rolloutrun_runtime.environments.checkpointing
    import rolloutrun_runtime.policy.family
    import rolloutrun_runtime.storage
    import rolloutrun_runtime.trainer_inputs
    forbidden = sorted(
        m for m in sys.modules if m.split(".")[0] in {forbidden}
    )
    unused = sorted(m for m in sys.modules if m.split(".")[0] in {unused})
    from pydantic import BaseModel

    def models(base):
        for sub in base.__subclasses__():
            yield sub
            yield from models(sub)

    built = sorted(  # a validator built at import (the config's and the wire's models)
        f"{{m.__module__}}.{{m.__qualname__}}" for m in set(models(BaseModel))
        if m.__module__.startswith("rolloutrun_runtime") and m.__pydantic_complete__
    )
    gc_on = seen.get("torch")
    print(json.dumps({{
        "code": code,
        "forbidden": forbidden,
        "unused": unused,
        "built": built,
        "gc_on_at_torch_import": gc_on,
        "keeper": seen.get("keeper"),
    }}))
    """
).format(forbidden=set(FORBIDDEN), unused=set(UNUSED_AT_START))


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``rolloutrun trainer`` with a missing config, in a fresh interpreter, in a pod's
    environment (a Lease, the Gym token): it imports torch before it reads the config, then
    exits 2 (its Lease keeper, with no API server to reach, exits too)."""
    missing = tmp_path_factory.mktemp("probe") / "missing.yaml"
    pod = {
        ENV_LEASE_NAME: "run-trainer",
        ENV_POD_NAMESPACE: "default",
        ENV_GYM_TOKEN: "gym-secret",
        "KUBECONFIG": str(missing.with_name("no-kubeconfig")),
    }
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(missing)],
        env={**os.environ, **pod},
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_trainer_entry_point_imports_no_operator_cluster_or_ray(probed) -> None:
    assert probed["code"] == 2  # the missing config is reported, after the command loaded
    assert probed["forbidden"] == []


def test_the_trainer_imports_nothing_a_built_in_policy_run_does_not_use(probed) -> None:
    assert probed["code"] == 2
    assert probed["unused"] == []


def test_no_model_of_the_config_or_the_wire_is_built_at_import(probed) -> None:
    """Pydantic builds a model's validator when its class is made unless ``defer_build``:
    ~50 ms of CPU at trainer start for models whose first use is the config's validation
    (built once, as one schema) or a request after the first redispatch, or never."""
    assert probed["code"] == 2
    assert probed["built"] == []


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["trainer", "--config", "x"], "trainer"),
        (["--log-level", "DEBUG", "gym", "--port", "0"], "gym"),
        (["--log-level=DEBUG", "trace", "dir"], "trace"),
        (["--help"], None),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_a_command_line_runs(argv: list[str], command: str | None) -> None:
    assert cli.command_named(argv) == command


def test_an_unknown_command_still_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    err = capsys.readouterr().err
    assert "trainer" in err and "crd" in err


def test_the_trainer_entry_point_imports_torch_with_the_cyclic_gc_off(probed) -> None:
    assert probed["code"] == 2 and probed["gc_on_at_torch_import"] is False


def test_the_trainer_starts_its_lease_keeper_before_torch_without_the_gym_token(probed) -> None:
    """The keeper imports the kubernetes client on another core while the trainer imports
    torch (so it starts first), and inherits the environment after the token was taken."""
    assert probed["keeper"] == {"torch": False, "token": False}


def test_imports_done_freezes_them_and_turns_the_gc_back_on() -> None:
    from rolloutrun_runtime.trainer import _imports_done

    # Frozen or not, read from one object of this test's own: the freeze count alone moves
    # whenever another test's thread frees an object frozen earlier (a CI flake: 8 fewer).
    sentinel = [object()]
    try:
        _imports_done()  # the collector was on: nothing changes
        assert gc.isenabled() and _collectable(sentinel)
        gc.disable()
        _imports_done()
        assert gc.isenabled() and not _collectable(sentinel)
    finally:
        gc.enable()
        gc.unfreeze()


def _collectable(obj: object) -> bool:
    """Whether the cyclic collector still scans `obj` (a frozen object is in no generation)."""
    return any(tracked is obj for tracked in gc.get_objects())
