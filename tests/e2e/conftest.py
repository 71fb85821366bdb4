"""Fixtures for the end-to-end tests (helpers live in e2e_helpers.py)."""

from __future__ import annotations

import pytest
from e2e_helpers import tiny_model


@pytest.fixture(scope="session")
def model() -> str:
    return str(tiny_model.ensure_tiny_model())
