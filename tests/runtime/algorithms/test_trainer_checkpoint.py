"""Trainer checkpoints: capture, atomic publication, retention and loading."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    CheckpointClashError,
    CheckpointIntegrityError,
    CheckpointWriter,
    TrainerCapture,
    TrainerCheckpointer,
    TrainerCheckpointError,
    capture_rng,
    decode_rng,
    encode_rng,
    restore_rng,
)
from rolloutrun_runtime.coordination import FencedError, FileLease
from rolloutrun_runtime.pod import PodLease, fenced_checkpointer
from rolloutrun_runtime.storage import open_storage, publish_entry


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


# ---------------------------------------------------------------------------- writers, safety
# (file:// and gs:// through the ``storage`` fixture of tests/conftest.py)

EXPLOIT_FLAG = "ROLLOUTRUN_TEST_EXPLOIT_FLAG"


def _exploit(path: str) -> str:
    """What a malicious pickle would call while being loaded (it must never run)."""
    Path(path).write_text("code ran")
    return "pwned"


class _Malicious:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (_exploit, (str(self.flag),))


def _writer(incarnation: int) -> CheckpointWriter:
    return CheckpointWriter(incarnation, f"run-trainer-{incarnation}/{incarnation}", "host:1")


def _other_weights(step: int) -> TrainerCapture:
    torch.manual_seed(1234)
    model, optimizer = _trained()
    return _capture(step, model, optimizer)


def test_a_step_another_trajectory_committed_is_a_clash_naming_both_writers(storage) -> None:
    model, optimizer = _trained()
    theirs = TrainerCheckpointer(storage, keep_latest=3, writer=_writer(2))
    theirs.publish(_other_weights(5))
    anchors: list[int] = []
    ours = fenced_checkpointer(storage, 3, None, anchors.append)
    ours.writer = _writer(3)
    with pytest.raises(CheckpointClashError) as raised:
        ours.publish(_capture(5, model, optimizer))
    message = str(raised.value)
    assert "incarnation 2 (lease holder run-trainer-2/2" in message
    assert "incarnation 3 (lease holder run-trainer-3/3" in message
    assert "model.pt" in message and storage.uri_for("step_5/COMMITTED") in message
    assert anchors == []  # the trainer does not anchor to the other trajectory's weights
    kept = ours.load(5)
    assert kept.writer == _writer(2)
    assert not torch.equal(kept.model_state["weight"], model.state_dict()["weight"])


def test_a_step_committed_with_the_same_weights_is_accepted(storage) -> None:
    model, optimizer = _trained()
    capture = _capture(5, model, optimizer)
    first = TrainerCheckpointer(storage, keep_latest=3, writer=_writer(2)).publish(capture)
    anchors: list[int] = []
    ours = fenced_checkpointer(storage, 3, None, anchors.append)
    ours.writer = _writer(3)
    retrained = _capture(5, model, optimizer)
    retrained.trainer_state["training_info"] = {"step_time": 0.5}  # a timing, not weights
    assert ours.publish(retrained) == first and anchors == [5]
    assert ours.load(5).writer == _writer(2)


def test_the_marker_names_its_writer_from_the_pod_environment() -> None:
    env = {
        "ROLLOUTRUN_INCARNATION": "4",
        "ROLLOUTRUN_LEASE_NAME": "r-trainer",
        "POD_NAMESPACE": "ns",
        "POD_NAME": "r-trainer-4",
    }
    writer = CheckpointWriter.from_environment(env)
    assert (writer.incarnation, writer.holder) == (4, "r-trainer-4/4")
    assert CheckpointWriter.from_environment({}).holder is None


def test_a_lease_lost_during_the_upload_commits_nothing(tmp_path) -> None:
    lease_path = tmp_path / "lease.json"
    old = FileLease(lease_path, "trainer-i1/1", 1, duration_seconds=30)
    old.acquire(timeout=5)
    storage = open_storage(f"file://{tmp_path}/ckpt")

    class TakenOverDuringUpload:
        """The first file write is where the next incarnation takes the lease over."""

        def __getattr__(self, name):
            return getattr(storage, name)

        def write_many(self, items) -> None:
            storage.write_many(items)
            FileLease(lease_path, "trainer-i2/2", 2, duration_seconds=30).acquire(timeout=5)

    checkpointer = fenced_checkpointer(TakenOverDuringUpload(), 3, PodLease(old).fence, None)
    model, optimizer = _trained()
    with pytest.raises(FencedError):
        checkpointer.publish(_capture(4, model, optimizer))
    assert storage.list("step_4") and checkpointer.committed_steps() == []


@pytest.mark.parametrize("name", ["model.pt", "rng.json", "trainer_state.json", "x/y.json"])
def test_a_file_changed_after_its_commit_refuses_the_checkpoint(storage, name) -> None:
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    model, optimizer = _trained()
    checkpointer.publish(_capture(3, model, optimizer))
    tampered = b'{"format": 2, "step": 3, "tampered": true}'
    if name == "model.pt":  # other weights that load fine: only the checksum tells
        tampered = _other_weights(3).to_files()[name]
    storage.write_bytes(f"step_3/{name}", tampered)
    with pytest.raises(CheckpointIntegrityError, match=rf"step_3/{name}: sha256 mismatch"):
        checkpointer.load(3, extra_names=("x/y.json",))


def test_a_listed_file_that_is_missing_refuses_the_checkpoint(storage) -> None:
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    model, optimizer = _trained()
    checkpointer.publish(_capture(3, model, optimizer))
    storage.delete("step_3/x/y.json")
    with pytest.raises(CheckpointIntegrityError, match=r"step_3/x/y.json: missing"):
        checkpointer.load(3, extra_names=("x/y.json",))


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt"])
def test_a_malicious_pickle_is_refused_and_never_run(storage, tmp_path, name) -> None:
    # Its writer even listed the right sha256: weights_only must refuse it on its own.
    flag = tmp_path / "flag"
    model, optimizer = _trained()
    files = _capture(2, model, optimizer).to_files()
    buffer = io.BytesIO()
    torch.save({"weight": _Malicious(flag)}, buffer)
    files[name] = buffer.getvalue()
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    checkpointer.publish_files(2, files)
    with pytest.raises(TrainerCheckpointError, match=rf"cannot read step_2/{name}"):
        checkpointer.load(2)
    assert not flag.exists()


def _legacy_entry(storage, step: int, model, optimizer, rng: object) -> None:
    """A step as format 1 wrote it: pickled RNG, ``{"step": N}`` marker, no checksums."""

    def saved(obj: object) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    files = {
        "model.pt": saved(model.state_dict()),
        "optimizer.pt": saved(optimizer.state_dict()),
        "rng.pt": saved(rng),
        "trainer_state.json": json.dumps({"format": 1, "step": step}).encode(),
    }
    publish_entry(
        storage, f"step_{step}", files, marker_payload=json.dumps({"step": step}).encode()
    )


def test_a_format_1_checkpoint_still_loads_and_restores_its_rng(storage, caplog) -> None:
    model, optimizer = _trained()
    rng = capture_rng()
    expected = (torch.rand(3), np.random.rand(2), random.random())
    _legacy_entry(storage, 6, model, optimizer, rng)
    loaded = TrainerCheckpointer(storage, keep_latest=3).load(6)
    assert "cannot be verified" in caplog.text and loaded.writer is None
    assert torch.equal(loaded.model_state["weight"], model.state_dict()["weight"])
    restore_rng(loaded.rng_state)
    again = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1])
    assert again[2] == expected[2]


def test_a_format_1_checkpoint_with_a_malicious_rng_pickle_is_refused(storage, tmp_path) -> None:
    flag = tmp_path / "flag"
    model, optimizer = _trained()
    _legacy_entry(storage, 6, model, optimizer, {"torch": _Malicious(flag)})
    with pytest.raises(TrainerCheckpointError, match=r"cannot read step_6/rng\.pt"):
        TrainerCheckpointer(storage, keep_latest=3).load(6)
    assert not flag.exists()


def _draws() -> tuple[bytes, bytes, float, float, float]:
    return (
        torch.rand(4).numpy().tobytes(),
        np.random.randn(3).tobytes(),
        float(np.random.randn()),
        random.random(),
        random.gauss(0.0, 1.0),
    )


def test_the_rng_state_round_trips_bit_exactly_through_storage(storage) -> None:
    np.random.randn()  # leave numpy's cached gaussian set
    random.gauss(0.0, 1.0)  # and Python's
    model, optimizer = _trained()
    capture = _capture(1, model, optimizer)
    expected = _draws()
    checkpointer = TrainerCheckpointer(storage, keep_latest=3)
    checkpointer.publish(capture)
    loaded = checkpointer.load(1)
    restore_rng(loaded.rng_state)
    assert _draws() == expected
    assert encode_rng(loaded.rng_state) == encode_rng(capture.rng_state)
    json.loads(checkpointer.storage.read_bytes("step_1/rng.json"))  # plain JSON, no pickle


def test_cuda_rng_states_are_encoded_as_bytes() -> None:
    state = capture_rng()
    state["cuda"] = [torch.arange(16, dtype=torch.uint8), torch.arange(3, 19, dtype=torch.uint8)]
    decoded = decode_rng(encode_rng(state), "rng.json")
    assert [t.tolist() for t in decoded["cuda"]] == [t.tolist() for t in state["cuda"]]


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"{}", json.dumps({"torch": "!!", "numpy": {}, "python": {}}).encode()],
)
def test_a_malformed_rng_state_is_refused(raw: bytes) -> None:
    with pytest.raises(TrainerCheckpointError, match=r"cannot read step_1/rng\.json"):
        decode_rng(raw, "step_1/rng.json")
