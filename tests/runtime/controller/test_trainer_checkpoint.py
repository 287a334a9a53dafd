"""Trainer checkpoints: capture, atomic publication, retention and loading."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    TrainerCapture,
    TrainerCheckpointer,
    TrainerCheckpointError,
    restore_rng,
)
from rolloutrun_runtime.storage import open_storage


def _capture(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    return TrainerCapture.take(
        step, model, optimizer, {"dataloader": {"epoch": 0, "position": step}}, {"x/y.json": b"{}"}
    )


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_publish_load_and_retention(tmp_path) -> None:
    storage = open_storage(f"file://{tmp_path}/ckpt")
    checkpointer = TrainerCheckpointer(storage, keep_latest=2)
    model, optimizer = _trained()
    for step in (1, 2, 3):
        checkpointer.publish(_capture(step, model, optimizer))
    assert checkpointer.committed_steps() == [2, 3]
    assert checkpointer.latest_step() == 3 and checkpointer.is_durable(2)
    assert not checkpointer.is_durable(1)
    loaded = checkpointer.load(3, extra_names=("x/y.json", "absent.bin"))
    assert loaded.trainer_state["dataloader"]["position"] == 3
    assert loaded.files["x/y.json"] == b"{}" and "absent.bin" not in loaded.files
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.model_state[key], value)
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    fresh.load_state_dict(loaded.optimizer_state)
    assert fresh.state_dict()["state"][0]["step"] == 1
    with pytest.raises(TrainerCheckpointError, match="not committed"):
        checkpointer.load(1)


def test_an_entry_without_its_marker_is_invisible(tmp_path) -> None:
    storage = open_storage(f"file://{tmp_path}/ckpt")
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    model, optimizer = _trained()
    for name, data in _capture(4, model, optimizer).to_files().items():
        storage.write_bytes(f"step_4/{name}", data)  # killed before the marker
    assert checkpointer.latest_step() is None
    checkpointer.publish(_capture(2, model, optimizer))
    assert checkpointer.committed_steps() == [2]


def test_a_step_an_earlier_incarnation_committed_is_kept_not_rewritten(tmp_path) -> None:
    # A resume from a snapshot anchored before step_5 retrains through step 5: publishing it
    # again must neither fail (crash-looping every incarnation) nor replace the durable one.
    storage = open_storage(f"file://{tmp_path}/ckpt")
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    model, optimizer = _trained()
    first = checkpointer.publish(_capture(5, model, optimizer))
    retrained = _capture(5, model, optimizer)
    retrained.trainer_state["dataloader"]["position"] = 99
    again = checkpointer.publish(retrained)
    assert again == first and checkpointer.committed_steps() == [5]
    assert checkpointer.load(5).trainer_state["dataloader"]["position"] == 5


def test_capture_copies_state_and_rng_roundtrips(tmp_path) -> None:
    model, optimizer = _trained()
    capture = _capture(1, model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(capture.model_state["weight"], model.weight)
    expected = (torch.rand(1), np.random.rand(), random.random())
    restore_rng(capture.rng_state)
    assert (torch.rand(1), np.random.rand(), random.random()) == expected
