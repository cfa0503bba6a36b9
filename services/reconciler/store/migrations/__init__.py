"""Alembic migrations for the reconciler's tables (shipped inside the package).

They live here rather than in a top-level folder so that an installed wheel
carries them: `llmgw migrate` finds this folder with `schema.script_location()`.
"""
