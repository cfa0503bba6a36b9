"""`llmgw apply -f catalog.yaml`: validate a catalog and publish only what changed.

The current catalog is read from the event log itself (the last message on
each catalog subject), so apply needs only NATS. Each event is published with
`Nats-Expected-Last-Subject-Sequence` set to what was read: if someone else
changed the same entry in between, the publish is refused and apply says so
rather than silently overwriting their change.

Unless the log no longer starts at seq 1: with retention (`bus.events_max_age_seconds`,
`events_max_bytes`) a declaration older than the limit is gone from the stream
while it still holds in the folded state, and a catalog read from the stream
alone would not know it: a tenant whose declaration expired could never be
removed, and its keys would keep working. So when the stream's history is
trimmed, apply also reads the folded catalog from the operator API
(`/api/catalog`) and takes every declaration the stream no longer has from
there (expected last subject sequence 0: the subject is empty). Without the
API it refuses, rather than diff against half a catalog.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml
from nats.js.errors import BadRequestError, NotFoundError

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.opcli import apiclient
from llmgw.reconciler.catalog import spec as catalog

CATALOG_SUBJECTS = f"{subjects.ROOT}.evt.catalog.>"
_WRONG_LAST_SEQUENCE = 10071


class ApplyError(RuntimeError):
    pass


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, metavar="FILE", help="catalog YAML file")
    apiclient.add_nats_argument(parser)
    apiclient.add_api_argument(parser)
    # Only read when retention trimmed the stream; /api/catalog needs an admin token.
    apiclient.add_token_argument(parser)
    apiclient.add_api_tls_arguments(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would change, publish nothing"
    )


def load_file(path: str) -> catalog.Catalog:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise catalog.CatalogError([f"cannot read the file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise catalog.CatalogError([f"not valid YAML: {exc}"]) from None
    return catalog.parse(data)


@dataclass(frozen=True)
class ApiAccess:
    """How apply reaches the operator API when it must: URL, token and TLS files from
    the flags; each one not given is found as `apiclient` finds it."""

    url: str | None = None
    token: str | None = None
    tls: apiclient.ApiTLS | None = None


async def read_current(js, api: ApiAccess | None = None) -> catalog.Current:
    """The catalog as the log has it now; where the log's history is trimmed, completed
    from the folded catalog that the operator API serves."""
    try:
        info = await js.stream_info(subjects.EVENTS_STREAM, subjects_filter=CATALOG_SUBJECTS)
    except NotFoundError:
        raise ApplyError(
            f"stream {subjects.EVENTS_STREAM} does not exist: start a reconciler "
            "(it provisions NATS) or `llmgw dev` first"
        ) from None
    current = catalog.Current()
    for subject in sorted(info.state.subjects or {}):
        msg = await js.get_last_msg(subjects.EVENTS_STREAM, subject)
        try:
            event = c.decode(msg.data, c.CatalogEvent)
        except c.ContractError as exc:
            print(f"warning: ignoring undecodable last event on {subject}: {exc}", file=sys.stderr)
            current.subject_seqs[subject] = msg.seq
            continue
        current.add(subject, msg.seq, event)
    if info.state.first_seq > 1:
        print(
            f"note: {subjects.EVENTS_STREAM} starts at seq {info.state.first_seq} (older "
            "events expired): reading the folded catalog from the operator API too",
            file=sys.stderr,
        )
        add_folded(current, await asyncio.to_thread(_folded_catalog, api or ApiAccess()))
    return current


def _folded_catalog(api: ApiAccess) -> dict:
    try:
        base = apiclient.find_api_url(api.url)
        return apiclient.get_json(base, "/api/catalog", token=api.token, tls=api.tls)
    except apiclient.ApiError as exc:
        hint = (
            " (llmgw apply needs an admin token: --token or LLMGW_API_TOKEN)"
            if exc.status == 403
            else ""
        )
        raise ApplyError(
            f"the event log no longer holds every catalog declaration (retention), and the "
            f"folded catalog cannot be read: {exc}{hint}"
        ) from None


def add_folded(current: catalog.Current, folded: dict) -> None:
    """Declarations the folded catalog has on subjects the stream no longer holds."""
    declared: list[c.Message] = [msgspec.convert(m, c.ModelDeclared) for m in folded["models"]]
    declared += [msgspec.convert(x, c.TenantDeclared) for x in folded["tenants"]]
    # An API older than adapters answers without them: then there are none to add.
    declared += [msgspec.convert(x, c.AdapterDeclared) for x in folded.get("adapters", [])]
    if folded["bands"]:
        declared.append(c.BandsDeclared(bands=msgspec.convert(folded["bands"], list[c.Band])))
    for event in declared:
        subject = subjects.subject_for(event)
        if subject not in current.subject_seqs:  # the stream's own word wins
            current.add(subject, 0, event)


async def _apply(
    cat: catalog.Catalog,
    nats_url: str,
    dry_run: bool,
    api: str | None = None,
    token: str | None = None,
    tls: apiclient.ApiTLS | None = None,
) -> int:
    try:
        options = apiclient.nats_options(nats_url)
    except apiclient.ApiError as exc:
        raise ApplyError(str(exc)) from None
    try:
        nc = await bus.connect(
            nats_url, name="llmgw-apply", wait_for_server=False, connect_timeout=3, **options
        )
    except Exception as exc:
        raise ApplyError(f"cannot reach NATS at {nats_url}: {exc}") from None
    try:
        js = nc.jetstream()
        current = await read_current(js, ApiAccess(api, token, tls))
        steps = catalog.plan(cat, current)
        if not steps:
            print("no changes")
            return 0
        for step in steps:
            print(("would publish: " if dry_run else "") + step.summary)
        if dry_run:
            return 0
        for step in steps:
            subject = subjects.subject_for(step.event)
            expected = current.subject_seqs.get(subject, 0)
            try:
                await bus.publish(
                    js,
                    step.event,
                    headers={"Nats-Expected-Last-Subject-Sequence": str(expected)},
                )
            except BadRequestError as exc:
                if exc.err_code == _WRONG_LAST_SEQUENCE:
                    raise ApplyError(
                        f"{step.summary}: the catalog changed while applying "
                        f"({subject} moved past seq {expected}); run llmgw apply again"
                    ) from None
                raise
        print(f"applied {len(steps)} change(s)")
        return 0
    finally:
        await bus.close_quietly(nc)


def run(args: argparse.Namespace) -> int:
    try:
        cat = load_file(args.file)
    except catalog.CatalogError as exc:
        for problem in exc.problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(
            _apply(
                cat,
                apiclient.find_nats_url(args.nats),
                args.dry_run,
                args.api,
                args.token,
                apiclient.api_tls_flags(args),
            )
        )
    except ApplyError as exc:
        print(f"llmgw apply: {exc}", file=sys.stderr)
        return 1
