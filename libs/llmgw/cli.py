"""The `llmgw` console script: one subcommand per service and per operator task.

Each subcommand lives in its own module, imported only when it is chosen, so
`llmgw --help` stays fast and a service's dependencies load only for that
service. A command module provides:

    def configure(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int        # exit status

Exit codes: 0 ok, 1 failure reported by the command, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from llmgw import __version__

# name -> (module, one-line help). Order is the order shown in --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "router": ("llmgw.router.cli", "run an OpenAI-compatible router"),
    "reconciler": ("llmgw.reconciler.cli", "run the reconciler (leader or standby)"),
    "agent": ("llmgw.agent.cli", "run a node agent"),
    "sim-engine": ("llmgw.simengine.cli", "run a vLLM-compatible engine simulator"),
    "dev": ("llmgw.dev.cluster", "run a whole local cluster with one command"),
    "migrate": ("llmgw.reconciler.store.migrate", "upgrade the database schema to head"),
    "apply": ("llmgw.reconciler.catalog.apply", "validate a catalog file and publish its changes"),
    "get": ("llmgw.opcli.get", "list nodes, models, replicas, endpoints or tenants"),
    "explain": ("llmgw.opcli.explain", "explain where a model is placed, or why not"),
    "events": ("llmgw.opcli.events", "tail or export the event log"),
    "audit": ("llmgw.reconciler.audit.cli", "replay the log and verify projections"),
    "keys": ("llmgw.keys", "make API keys and their hashes"),
    "schemas": ("llmgw.schemas", "export or check the generated message schemas"),
    "certs": ("llmgw.certs", "create development certificates for NATS mTLS"),
    "nats-config": ("llmgw.natsconfig", "write a nats-server config for mTLS identities"),
}


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 with a usage line on bad input; keep that, name the program."""


def _first_command(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmgw", description="llmgw: one OpenAI endpoint for a fleet of LLM engines"
    )
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _first_command(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name and module.startswith(exc.name):
                    parser.exit(1, f"llmgw: '{name}' is not available in this build ({exc.name})\n")
                raise
            mod.configure(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`llmgw get nodes | head`): nothing more to say, and no
        # traceback. stdout is pointed at /dev/null so the interpreter's own flush at
        # exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
