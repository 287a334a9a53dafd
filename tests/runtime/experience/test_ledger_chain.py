"""A snapshot's ledger sidecar is a head (schema 6) and a chain of chunks: a snapshot writes
only the groups changed since the last published one, the reader rebuilds the ledger the
whole encoding gives (same groups, same order), and a head whose chunk is missing or
altered is refused with an error naming the chunk."""

from __future__ import annotations

import json

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import SegmentWriter
from rolloutrun_runtime.contract.layout import LEDGER_CHAIN_SCHEMA_VERSION
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.experience.rollout_recovery import (
    LedgerSidecarError,
    RecoveryLedger,
    read_recovery_sidecar,
)
from tests.runtime.experience.test_ledger_capture import CUT, SIDECAR, _finish, _reserve


def _snapshot(writer: SegmentWriter, ledger: RecoveryLedger, stored: dict[str, bytes]):
    """One snapshot's ledger part through the writer, published: (head, chunks written)."""
    sidecar = writer.stage_ledger(ledger.sidecar_capture(**SIDECAR))
    write = writer.prepare(DataPlane().copy(), {})
    stored.update(write.files_to_write())
    writer.commit(write)
    return sidecar, write


def _assert_reads_back_as_the_whole_encoding(sidecar, ledger, stored) -> None:
    recovered = read_recovery_sidecar(
        sidecar.data,
        expected_sha256=sidecar.sha256,
        expected_schema=LEDGER_CHAIN_SCHEMA_VERSION,
        expected_group_count=len(ledger),
        chunks=stored,
    )
    whole = json.loads(ledger.to_sidecar(**SIDECAR).data)
    again = recovered.ledger.sidecar_document(
        spare_prompts=recovered.spare_prompts or [],
        batch_shortfall=recovered.batch_shortfall,
        sampler_stamps_target_steps=recovered.sampler_stamps_target_steps,
    )
    assert json.loads(json.dumps(again)) == whole  # same groups, same order, same rest


def test_a_snapshot_writes_only_the_groups_changed_since_the_last() -> None:
    ledger, writer, stored = RecoveryLedger(), SegmentWriter(), {}
    ids = [_reserve(ledger, i) for i in range(200)]
    first, base = _snapshot(writer, ledger, stored)
    assert json.loads(first.data)["schema_version"] == LEDGER_CHAIN_SCHEMA_VERSION
    assert base.ledger_chain is not None and base.ledger_chain.put == 200
    _assert_reads_back_as_the_whole_encoding(first, ledger, stored)
    _, unchanged = _snapshot(writer, ledger, stored)
    assert unchanged.ledger_chain is not None and unchanged.ledger_chain.new_files == {}
    _finish(ledger, ids[3])  # changed in place
    _reserve(ledger, 500)  # new, at the end
    ledger.claim(CUT, [ids[3]], 1)
    ledger.remove_trained(CUT, [ids[3]], 1)  # and gone
    _finish(ledger, ids[7])
    sidecar, delta = _snapshot(writer, ledger, stored)
    assert delta.ledger_chain is not None and not delta.ledger_chain.rewritten
    assert delta.ledger_chain.put == 2  # pg0007 and pg0500, not the 200 groups
    (chunk,) = delta.ledger_chain.new_files.values()
    assert json.loads(chunk)["drop"] == [ids[3]]
    _assert_reads_back_as_the_whole_encoding(sidecar, ledger, stored)


def test_a_missing_or_altered_chunk_is_refused_by_name() -> None:
    ledger, writer, stored = RecoveryLedger(), SegmentWriter(), {}
    for i in range(5):
        _reserve(ledger, i)
    sidecar, write = _snapshot(writer, ledger, stored)
    assert write.ledger_chain is not None
    (key,) = write.ledger_chain.new_files
    with pytest.raises(LedgerSidecarError, match=f"chunk {key} is missing"):
        read_recovery_sidecar(sidecar.data, chunks={})
    with pytest.raises(LedgerSidecarError, match=f"chunk {key} is truncated"):
        read_recovery_sidecar(sidecar.data, chunks={key: stored[key][:-1]})
    head = json.loads(sidecar.data)
    head["groups"] = []
    with pytest.raises(LedgerSidecarError, match="groups_chain, not groups"):
        read_recovery_sidecar(json.dumps(head).encode(), chunks=stored)
