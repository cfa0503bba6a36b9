"""`llmgw schemas export|check`: JSON Schemas and an AsyncAPI 3.0 document from the contract.

The files in schemas/ are generated from llmgw.contracts and llmgw.subjects and
never edited by hand; `check` fails when the committed files differ from what
the code generates, so the contract and its documents cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import yaml

from llmgw import __version__
from llmgw import contracts as c
from llmgw import subjects as s

CONSUMERS = {
    "agentEvents": ["reconciler"],
    "catalogEvents": ["reconciler"],
    "controlEvents": ["reconciler"],
    "heartbeats": ["reconciler"],
    "commands": ["agent"],
    "loadSamples": ["router"],
    "endpointProjection": ["router"],
    "tenantProjection": ["router"],
    "routerPresence": ["router"],
}


def _schema_file(cls: type[c.Message]) -> str:
    return f"{c.type_tag(cls)}.json"


def _dump_json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def generate() -> dict[str, str]:
    """File name (relative to schemas/) -> content."""
    files: dict[str, str] = {}
    for cls in c.ALL_MESSAGES:
        schema = msgspec.json.schema(cls)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = cls.__name__
        schema["description"] = cls.summary
        files[_schema_file(cls)] = _dump_json(schema)
    files["asyncapi.yaml"] = _asyncapi()
    return files


def _asyncapi() -> str:
    _, components = msgspec.json.schema_components(
        c.ALL_MESSAGES, ref_template="#/components/schemas/{name}"
    )
    messages = {}
    for cls in c.ALL_MESSAGES:
        messages[cls.__name__] = {
            "name": c.type_tag(cls),
            "title": cls.__name__,
            "summary": cls.summary,
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{cls.__name__}"},
            "x-publisher": cls.publisher,
        }
    channels = {}
    operations = {}
    for name, address, stream, msgs in s.CHANNELS:
        params = {}
        for part in address.split("."):
            if part.startswith("{") and part.endswith("}"):
                params[part[1:-1]] = {"description": f"the {part[1:-1]} this message concerns"}
        channel: dict = {
            "address": address,
            "messages": {m.__name__: {"$ref": f"#/components/messages/{m.__name__}"} for m in msgs},
            "description": (f"JetStream stream {stream}" if stream else "core NATS, not persisted"),
        }
        if params:
            channel["parameters"] = params
        channels[name] = channel
        publishers = sorted({m.publisher for m in msgs})
        for pub in publishers:
            operations[f"{pub}Sends_{name}"] = {
                "action": "send",
                "channel": {"$ref": f"#/channels/{name}"},
                "summary": f"{pub} publishes",
                "messages": [
                    {"$ref": f"#/channels/{name}/messages/{m.__name__}"}
                    for m in msgs
                    if m.publisher == pub
                ],
            }
        for consumer in CONSUMERS.get(name, []):
            operations[f"{consumer}Receives_{name}"] = {
                "action": "receive",
                "channel": {"$ref": f"#/channels/{name}"},
                "summary": f"{consumer} consumes",
            }
    doc = {
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmgw message bus",
            "version": __version__,
            "description": "Generated from llmgw.contracts by `llmgw schemas export`; do not edit.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": components},
    }
    return yaml.safe_dump(doc, sort_keys=True, width=120)


def default_dir() -> Path:
    # The repository's schemas/ when run from a checkout; else the working directory's.
    here = Path(__file__).resolve().parents[2] / "schemas"
    return here if here.parent.joinpath("pyproject.toml").exists() else Path("schemas")


def export(out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = generate()
    for name, content in files.items():
        (out_dir / name).write_text(content)
    stale = [
        p.name for p in out_dir.iterdir() if p.suffix in (".json", ".yaml") and p.name not in files
    ]
    for name in stale:
        (out_dir / name).unlink()
    return sorted(files)


def check(out_dir: Path) -> list[str]:
    """Names of files that differ, are missing, or should not be there."""
    files = generate()
    problems = []
    for name, content in sorted(files.items()):
        path = out_dir / name
        if not path.exists():
            problems.append(f"missing: {name}")
        elif path.read_text() != content:
            problems.append(f"differs: {name}")
    if out_dir.exists():
        for p in sorted(out_dir.iterdir()):
            if p.suffix in (".json", ".yaml") and p.name not in files:
                problems.append(f"not generated by the code: {p.name}")
    return problems


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["export", "check"], help="write the files, or compare them"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="schemas folder (default: the repository's)"
    )


def run(args: argparse.Namespace) -> int:
    out_dir = args.dir or default_dir()
    if args.action == "export":
        names = export(out_dir)
        print(f"wrote {len(names)} files to {out_dir}")
        return 0
    problems = check(out_dir)
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        print(
            "schemas are stale: run `llmgw schemas export` and commit the result", file=sys.stderr
        )
        return 1
    print(f"schemas in {out_dir} match the code")
    return 0
