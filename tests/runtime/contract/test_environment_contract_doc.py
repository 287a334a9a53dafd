"""docs/environment-contract.md's JSON examples are bodies the wire models accept.

The page shows the wire by example; the models in ``contract/wire.py`` are the contract.
An example that drifts from its model (a renamed field, a missing one) fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rolloutrun_runtime.contract.wire import (
    CompletionRequest,
    GymHealth,
    PolicyAnnouncement,
    RunRequest,
    RunResult,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "environment-contract.md"
#: The page's ```json blocks, in order, and the model each one shows.
SHOWN = [GymHealth, PolicyAnnouncement, RunRequest, CompletionRequest, RunResult]


def test_every_json_example_is_a_valid_body_of_its_model() -> None:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == len(SHOWN)
    for block, model in zip(blocks, SHOWN, strict=True):
        model.model_validate(json.loads(block))  # raises naming the field
    # The segments of the result add up to the turns the request's prompt led to.
    result = RunResult.model_validate(json.loads(blocks[-1]))
    assert [s.kind for s in result.segments] == ["prompt", "model", "env", "model"]
    assert (
        result.segments[0].token_ids
        == CompletionRequest.model_validate(json.loads(blocks[3])).prompt_token_ids
    )
