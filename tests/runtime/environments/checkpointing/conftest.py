"""Fixtures of the Gym checkpoint tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.gym_checkpoint_rig import Rig


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path)
    await rig.start_policy()
    yield rig
    await rig.close()
