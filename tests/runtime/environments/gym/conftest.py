"""Fixtures of the Gym's tests."""

from __future__ import annotations

import pytest

from rolloutrun_runtime.policy.generation import GenerationEngine
from tests.support.scripted_gym import scripted_engine


@pytest.fixture
def engine() -> GenerationEngine:
    """The in-process generation engine with scripted weights (each turn answers ``+1``)."""
    return scripted_engine()
