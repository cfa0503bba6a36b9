"""Fixtures shared by integration tests (the servers themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from llmgw.reconciler.store import schema


@pytest.fixture
async def engine(database_url):
    """A SQLAlchemy engine on a fresh database migrated to head."""
    eng = schema.make_engine(database_url)
    await schema.upgrade(eng)
    try:
        yield eng
    finally:
        await eng.dispose()
