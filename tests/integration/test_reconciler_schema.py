"""Migrations: empty -> head -> base, the models match them, and services refuse an old schema."""

from __future__ import annotations

import subprocess

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from llmgw import procs
from llmgw.reconciler.store import schema, tables


async def _tables(engine) -> set[str]:
    async with engine.connect() as conn:
        res = await conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        )
        return {r[0] for r in res}


def _llmgw(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(procs.llmgw_argv(*args), capture_output=True, text=True, timeout=60)


async def test_upgrade_from_empty_matches_the_models_and_downgrades_to_base(database_url):
    engine = schema.make_engine(database_url)
    try:
        res = _llmgw("migrate", "--database-url", database_url)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == f"schema at {schema.head_revision()}"
        assert {t.name for t in tables.Base.metadata.sorted_tables} <= await _tables(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda c: compare_metadata(
                    MigrationContext.configure(c, opts={"compare_type": True}),
                    tables.Base.metadata,
                )
            )
        assert diff == []
        await schema.require_head(engine)
        # Running it again is a no-op, not an error.
        await schema.upgrade(engine)

        await schema.downgrade(engine, "base")
        assert await _tables(engine) == {"alembic_version"}
    finally:
        await engine.dispose()


def test_reconciler_refuses_a_schema_that_is_not_at_head(database_url, nats_url):
    res = _llmgw(
        "reconciler", "--database-url", database_url, "--nats", nats_url,
        "--admin-listen", "127.0.0.1:0",
    )  # fmt: skip
    assert res.returncode == 1
    assert "llmgw migrate" in res.stderr and "empty" in res.stderr


def test_migrate_reports_an_unreachable_database():
    res = _llmgw("migrate", "--database-url", "postgresql://postgres@127.0.0.1:1/none")
    assert res.returncode == 1
    assert "cannot migrate" in res.stderr


async def test_replica_counters_go_and_a_downgrade_refills_them_from_the_replicas(database_url):
    # The next replica number is derived from the replicas (a retired one keeps its row);
    # an older reconciler after a downgrade must find the counters it would have written.
    engine = schema.make_engine(database_url)
    try:
        await schema.upgrade(engine, "0008")
        async with engine.begin() as conn:
            for rid, model, retired in (
                ("m-r1", "m", False), ("m-r3", "m", True), ("org_x-r7", "org/x", True),
            ):  # fmt: skip
                await conn.execute(
                    text(
                        "INSERT INTO replicas (replica_id, model, assignments, decided_seq,"
                        " profile_digest, retired, retired_reason)"
                        " VALUES (:r, :m, '[]', 1, '', :t, '')"
                    ),
                    {"r": rid, "m": model, "t": retired},
                )
            await conn.execute(text("INSERT INTO replica_counters VALUES ('m', 3), ('org/x', 7)"))
        await schema.upgrade(engine)
        assert "replica_counters" not in await _tables(engine)
        await schema.downgrade(engine, "0008")
        async with engine.connect() as conn:
            res = await conn.execute(text("SELECT model, last_n FROM replica_counters"))
            assert sorted(tuple(r) for r in res) == [("m", 3), ("org/x", 7)]
    finally:
        await engine.dispose()
