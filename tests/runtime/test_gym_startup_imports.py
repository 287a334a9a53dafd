"""A Gym replica's start-up does only what serving needs (issue 14: a replaced Gym's start is
most of a member replacement). Checked on the real entry point (``rolloutrun gym``'s
handler, in a child process, until it prints READY and so serves):

- it imports none of the trainer's, the generation's or the operator's heavy modules
  (torch, transformers, Ray, kopf, the operator, the local cluster, the trainer's centre);
- no cyclic-GC pass runs from the handler's start until it serves (each pass walks the
  growing heap of imports again, for nothing), and afterwards the GC is on with start-up's
  objects frozen out of its passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from tests.support.run_configs import tiny_config

FORBIDDEN = (
    "torch",
    "transformers",
    "ray",
    "kopf",
    "numpy",
    "rolloutrun_operator",
    "rolloutrun_localcluster",
    "rolloutrun_runtime.trainer",
    "rolloutrun_runtime.algorithms",
    "rolloutrun_runtime.workers",
    "rolloutrun_runtime.policy.engine",
)

#: The Gym's own handler (as ``rolloutrun gym`` dispatches it); at READY it records what was
#: imported and the GC passes since the handler started, then stops the replica (SIGTERM).
_PROBE = textwrap.dedent(
    """
    import gc, json, os, signal, sys
    from rolloutrun_runtime.cli import build_parser

    forbidden = tuple(json.loads(sys.argv[2]))
    args = build_parser(only="gym").parse_args(["gym", "--config", sys.argv[1], "--port", "0"])
    passes, seen = [], {}
    gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(1))

    class AtReady:
        def __init__(self, out):
            self.out = out
        def write(self, text):
            if text.startswith("READY ") and not seen:
                seen["passes"] = len(passes)
                seen["forbidden"] = sorted(
                    m for m in sys.modules if any(
                        m == f or m.startswith(f + ".") for f in forbidden
                    )
                )
                seen["gc_on"] = gc.isenabled()
                seen["frozen"] = gc.get_freeze_count()
                os.kill(os.getpid(), signal.SIGTERM)
            return self.out.write(text)
        def flush(self):
            self.out.flush()

    sys.stdout = AtReady(sys.stdout)
    code = args.handler(args)
    sys.stdout = sys.stdout.out
    print(json.dumps({"code": code, "gc_on_after": gc.isenabled(), **seen}))
    """
)


def _gym_config(tmp_path: Path) -> Path:
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path).to_yaml_dict()))
    return config


def test_a_gym_serves_without_heavy_imports_or_gc_passes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(_gym_config(tmp_path)), json.dumps(FORBIDDEN)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, ENV_GYM_TOKEN: "gym-token"},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0  # served, then stopped by its SIGTERM
    assert result["forbidden"] == []
    assert result["passes"] == 0, "a cyclic-GC pass ran during the Gym's start-up"
    assert result["gc_on"] and result["gc_on_after"]
    assert result["frozen"] > 0  # start-up's objects are out of future passes
