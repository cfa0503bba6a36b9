"""The route table: model names and aliases to models, each model's fallback chain,
and the LoRA adapters declared on each model.

Pure: built from the per-model records (`contracts.ModelEndpoints`) whether they
come from the router's file or from the control plane. `check` lists every
problem by name (the config loader refuses to start on any); `build` drops
what is wrong and keeps the rest, because a live update from the control plane
must never take the router down: a faulty alias or fallback is dropped alone, a
record naming a scheduling plugin this router does not have is dropped whole.

An adapter's name is what its requests put in `model`, as vLLM serves it (the
`lora_name` it was loaded under); SGLang's `<base>:<adapter>` form names it too. It
must not be a model, an alias or another adapter, or requests would misroute silently:
one that clashes is dropped and reported, as the catalog refuses it at apply.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw.contracts import AdapterRoute, ModelEndpoints, SchedulingSpec, UpstreamSpec
from llmgw.router.request import kinds
from llmgw.router.scheduling import pipeline as scheduling

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class RouteTable:
    records: dict[str, ModelEndpoints]  # by canonical model name
    names: dict[str, str]  # model name or alias -> canonical model name
    chains: dict[str, tuple[str, ...]]  # model, then its fallbacks (transitively) in order
    # The problems that name a fallback with no record: one that has not arrived yet
    # (the control plane writes a record per model) reads the same (problemlog.py).
    missing: frozenset[str] = frozenset()
    # adapter name -> (its base model, the adapter as declared)
    adapters: dict[str, tuple[str, AdapterRoute]] = field(default_factory=dict)

    def adapter(self, name: str) -> str | None:
        """The adapter a request's `model` names: its own name, or SGLang's
        `<base>:<adapter>` (base a model or alias); None when it names none."""
        if name in self.adapters:
            return name
        start = name.find(":")
        while start > 0:
            base, adapter = self.names.get(name[:start]), name[start + 1 :]
            found = self.adapters.get(adapter)
            if base is not None and found is not None and found[0] == base:
                return adapter
            start = name.find(":", start + 1)
        return None


def _unknown_plugins(where: str, sched: SchedulingSpec) -> list[str]:
    """Scheduling plugins this router does not have: it cannot build the model's
    pipeline, so the whole record is dropped."""
    problems = [
        f"{where}: scheduling.filters: unknown filter {name!r} "
        f"(known: {', '.join(sorted(scheduling.FILTERS))})"
        for name in sched.filters
        if name not in scheduling.FILTERS
    ]
    problems += [
        f"{where}: scheduling.scorers: unknown scorer {name!r} "
        f"(known: {', '.join(sorted(scheduling.SCORERS))})"
        for name in sched.scorers
        if name not in scheduling.SCORERS
    ]
    if sched.picker not in scheduling.PICKERS:
        problems.append(
            f"{where}: scheduling.picker: unknown picker {sched.picker!r} "
            f"(known: {', '.join(sorted(scheduling.PICKERS))})"
        )
    return problems


def _spec_problems(where: str, rec: ModelEndpoints) -> list[str]:
    """What is wrong in a record the router can still serve: reported (a router file
    with any is refused), while a live record is served all the same."""
    problems = []
    for key in ("connect", "headers", "first_token", "idle", "total"):
        value = getattr(rec.deadlines, key)
        if not value > 0:
            problems.append(f"{where}: deadlines.{key} = {value}: must be positive")
    for name, weight in rec.scheduling.scorers.items():
        if name in scheduling.SCORERS and not weight >= 0:
            problems.append(f"{where}: scheduling.scorers.{name} = {weight}: must be >= 0")
    for kind in rec.api_kinds:
        if kind not in kinds.BY_NAME:
            problems.append(
                f"{where}: api_kinds: unknown kind {kind!r} "
                f"(known: {', '.join(k.name for k in kinds.ALL)})"
            )
    problems += upstream_problems(where, rec.upstream)
    for ep in rec.endpoints:
        problems += upstream_problems(f"{where}: endpoint {ep.id!r}", ep.upstream)
    return problems


def upstream_problems(where: str, spec: UpstreamSpec) -> list[str]:
    """Header names and values that would break a request, and secrets whose
    environment variable this router does not have."""
    problems = []
    for name, value in [*spec.headers.items(), *spec.secret_headers.items()]:
        if not _TOKEN(name):
            problems.append(f"{where}: upstream header {name!r} is not a valid header name")
        if _CONTROL.search(value):
            problems.append(f"{where}: upstream header {name!r} holds a control character")
    for name, env in spec.secret_headers.items():
        if env not in os.environ:
            problems.append(
                f"{where}: upstream secret header {name!r}: environment variable {env!r} is not set"
            )
    return problems


def build(records: Iterable[ModelEndpoints]) -> tuple[RouteTable, list[str]]:
    """The usable route table and the problems that were skipped to get it."""
    problems: list[str] = []
    by_name = _servable(records, problems)
    names = _names(by_name, problems)
    missing: list[str] = []
    fallbacks = _fallbacks(by_name, names, problems, missing)
    cut = _cut_cycles(fallbacks, problems)
    chains = {model: _chain(model, fallbacks, cut) for model in by_name}
    problems += _url_clashes(by_name)
    adapters = _adapters(by_name, names, problems)
    return RouteTable(by_name, names, chains, frozenset(missing), adapters), problems


def _servable(records: Iterable[ModelEndpoints], problems: list[str]) -> dict[str, ModelEndpoints]:
    """The records by model name, less repeats and those the router cannot serve."""
    seen: set[str] = set()
    by_name: dict[str, ModelEndpoints] = {}
    for rec in records:
        if rec.model in seen:
            problems.append(f"model {rec.model!r}: declared more than once")
            continue
        seen.add(rec.model)
        where = f"model {rec.model!r}"
        unknown = _unknown_plugins(where, rec.scheduling)
        problems += unknown + _spec_problems(where, rec)
        if not unknown:
            by_name[rec.model] = rec
    return by_name


def _names(by_name: dict[str, ModelEndpoints], problems: list[str]) -> dict[str, str]:
    """Each model name and alias -> its model; an alias that clashes is dropped."""
    names = {name: name for name in by_name}
    for rec in by_name.values():
        for alias in rec.aliases:
            if alias in by_name:
                problems.append(f"model {rec.model!r}: alias {alias!r} shadows model {alias!r}")
            elif alias in names:
                problems.append(
                    f"model {rec.model!r}: alias {alias!r} is already an alias of "
                    f"model {names[alias]!r}"
                )
            else:
                names[alias] = rec.model
    return names


def _adapters(
    by_name: dict[str, ModelEndpoints], names: dict[str, str], problems: list[str]
) -> dict[str, tuple[str, AdapterRoute]]:
    """Each adapter -> (its base model, itself); one whose name is already a model, an
    alias or another adapter is dropped."""
    adapters: dict[str, tuple[str, AdapterRoute]] = {}
    for rec in by_name.values():
        for adapter in rec.adapters:
            name = adapter.name
            if name in names:
                what = "model" if names[name] == name else f"an alias of model {names[name]!r}"
                problems.append(f"model {rec.model!r}: adapter {name!r} is {what}")
            elif name in adapters:
                problems.append(
                    f"model {rec.model!r}: adapter {name!r} is already an adapter of "
                    f"model {adapters[name][0]!r}"
                )
            else:
                adapters[name] = (rec.model, adapter)
    return adapters


def _fallbacks(
    by_name: dict[str, ModelEndpoints],
    names: dict[str, str],
    problems: list[str],
    missing: list[str],
) -> dict[str, list[str]]:
    """Each model's fallbacks as models: they may name a model or an alias; those that
    resolve to nothing (also listed in `missing`) or to the model itself are dropped."""
    fallbacks: dict[str, list[str]] = {}
    for rec in by_name.values():
        resolved = []
        for fb in rec.fallbacks:
            target = names.get(fb)
            if target is None:
                problem = f"model {rec.model!r}: fallback {fb!r} is not a declared model or alias"
                problems.append(problem)
                missing.append(problem)
            elif target == rec.model:
                problems.append(f"model {rec.model!r}: fallback {fb!r} is the model itself")
            else:
                resolved.append(target)
        fallbacks[rec.model] = resolved
    return fallbacks


def _cut_cycles(fallbacks: dict[str, list[str]], problems: list[str]) -> set[tuple[str, str]]:
    """The fallback edges that close a cycle, each reported.

    A fallback chain is walked depth first; a cycle would make "try the fallbacks of
    the fallback" loop, so the edge closing it is cut."""
    cut: set[tuple[str, str]] = set()

    def visit(model: str, path: list[str]) -> None:
        for fb in fallbacks[model]:
            if (model, fb) in cut:
                continue
            if fb in path:
                cycle = " -> ".join([*path[path.index(fb) :], fb])
                problems.append(f"model {model!r}: fallbacks form a cycle: {cycle}")
                cut.add((model, fb))
                continue
            visit(fb, [*path, fb])

    for model in fallbacks:
        visit(model, [model])
    return cut


def _chain(
    model: str, fallbacks: dict[str, list[str]], cut: set[tuple[str, str]]
) -> tuple[str, ...]:
    """The model, then its fallbacks depth first (transitively), each once."""
    order: list[str] = []

    def walk(m: str) -> None:
        if m in order:
            return
        order.append(m)
        for fb in fallbacks[m]:
            if (m, fb) not in cut:
                walk(fb)

    walk(model)
    return tuple(order)


def _url_clashes(by_name: dict[str, ModelEndpoints]) -> list[str]:
    """Endpoints that two models list with different URLs: one id is one engine."""
    problems = []
    seen_urls: dict[str, str] = {}
    for rec in by_name.values():
        for ep in rec.endpoints:
            first = seen_urls.setdefault(ep.id, ep.url)
            if first != ep.url:
                problems.append(
                    f"model {rec.model!r}: endpoint {ep.id!r} has url {ep.url!r}, "
                    f"but another model lists it with {first!r}"
                )
    return problems


def check(records: Iterable[ModelEndpoints]) -> list[str]:
    return build(records)[1]
