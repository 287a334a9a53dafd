"""A bad prompt file fails the run once, like a missing model, instead of a restart loop.

The trainer's real entry point reads the file and exits; its exit code and last line become
the pod's terminated state (``FallbackToLogsOnError``); the pure reconcile decides from them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rolloutrun_operator.reconcile import reconcile
from rolloutrun_runtime import trainer as trainer_entry
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE
from tests.support.rolloutruns import (
    NOW,
    condition,
    make_run,
    members,
    observed,
    running_status,
    trainer,
)

BAD_FILES = {
    # name: (file contents or None for absent, what the error names)
    "absent": (None, "cannot read the prompt file"),
    "malformed row": ('{"question": "1+1="}\n{"question": \n', "row 2: not valid JSON"),
    "missing field": ('{"question": "1+1="}\n{"q": "2+2="}\n', "row 2: no field 'question'"),
}


def _trainer_exit(tmp_path: Path, contents: str | None, capsys: pytest.CaptureFixture[str]):
    prompts = tmp_path / "prompts.jsonl"
    if contents is not None:
        prompts.write_text(contents)
    config = tmp_path / "run.yaml"
    dataset = {"uri": str(prompts), "promptField": "question"}
    config.write_text(
        json.dumps(
            {
                "logDir": str(tmp_path / "run"),
                "task": {"name": "external", "dataset": dataset},
                "gym": {"replicas": 1, "endpoints": ["http://127.0.0.1:9"]},
                "workers": {"backend": "inprocess"},
            }
        )
    )
    code = trainer_entry.main(argparse.Namespace(config=str(config), log_dir=None))
    return code, capsys.readouterr().err, prompts


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_prompt_file_exits_with_the_configuration_code(tmp_path, capsys, case):
    contents, named = BAD_FILES[case]
    code, err, prompts = _trainer_exit(tmp_path, contents, capsys)
    assert code == UNRESTORABLE_EXIT_CODE
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert f"{prompts}: " in err and named in err


def test_the_operator_fails_the_run_naming_the_file_row_and_field(tmp_path, capsys):
    code, err, prompts = _trainer_exit(tmp_path, BAD_FILES["missing field"][0], capsys)
    pod = trainer(1, phase="Failed", exit_code=code, terminated_message=err)
    others = tuple(p for p in members(1) if p.name != pod.name)
    result = reconcile(make_run(running_status()), observed((pod, *others)), NOW)
    failed = condition(result, "Failed")
    assert failed[:2] == ("True", "Unrestorable")
    assert f"{prompts}: row 2: no field 'question' (task.dataset.promptField)" in failed[2]
    assert condition(result, "Restarting")[:2] == ("False", "Failed")
    assert result.status.restarts == 0 and result.status.next_start_time is None
