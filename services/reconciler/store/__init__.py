"""Step 3 of an event's path, `intake -> state -> store -> controllers`: Postgres.

`tables` declares the projection tables and the archive, `rows` maps state to rows,
`store` loads the state and commits a batch with its position in one transaction,
`schema` and `migrate` keep the schema at head (Alembic revisions in `migrations/`), and
`streamid` ties the stored position to the stream it counts.
"""
