"""`llmgw audit ...`: checks that the log explains the state.

Each subcommand is a module with `configure(parser)` and `run(args) -> int`,
listed in SUBCOMMANDS; adding one is one line here.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "verify": (
        "llmgw.reconciler.audit.verify",
        "fold the archive from seq 1 and compare with the live projection tables",
    ),
    "rebuild": (
        "llmgw.reconciler.audit.rebuild",
        "rewrite every projection table from the archive (reconcilers stopped)",
    ),
    "replay": (
        "llmgw.reconciler.audit.replay_cli",
        "re-derive every placement decision with today's code and show differences",
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_command", metavar="CHECK", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.configure(p)
        p.set_defaults(_audit_run=mod.run)


def run(args: argparse.Namespace) -> int:
    return args._audit_run(args)
