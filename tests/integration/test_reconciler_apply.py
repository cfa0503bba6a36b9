"""`llmgw apply` on real NATS: validation errors, publishing only changes, idempotence."""

from __future__ import annotations

import asyncio
import subprocess

from llmgw import bus, procs
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.catalog import apply as apply_cli

KEY = "sha256:" + "cd" * 32
CATALOG = f"""
bands:
  - {{name: interactive, ceiling: 1.5}}
  - {{name: batch, ceiling: 0.8}}
models:
  - name: llama
    aliases: [llama3]
    replicas: 2
    profile: {{engine: sim, gpus_per_shard: 1}}
  - name: qwen
    fallbacks: [llama]
tenants:
  - {{name: acme, band: interactive, key_hashes: ["{KEY}"], quotas: {{rpm: 60}}}}
"""


async def log_types(js) -> list[str]:
    info = await js.stream_info(s.EVENTS_STREAM)
    out = []
    for seq in range(info.state.first_seq or 1, info.state.last_seq + 1):
        out.append(c.decode((await js.get_msg(s.EVENTS_STREAM, seq)).data))
    return [f"{type(m).__name__}:{getattr(m, 'name', '')}" for m in out]


async def apply(tmp_path, text: str, nats_url: str, dry_run: bool = False) -> int:
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    return await apply_cli._apply(apply_cli.load_file(str(path)), nats_url, dry_run)


async def test_apply_publishes_changes_only_and_reapply_publishes_nothing(
    js, nats_url, tmp_path, capsys
):
    await bus.provision(js)
    assert await apply(tmp_path, CATALOG, nats_url, dry_run=True) == 0
    assert "would publish: model llama: declared" in capsys.readouterr().out
    assert (await js.stream_info(s.EVENTS_STREAM)).state.last_seq == 0

    assert await apply(tmp_path, CATALOG, nats_url) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bands: set to interactive, batch",
        "model llama: declared",
        "model qwen: declared",
        "tenant acme: declared",
        "applied 4 change(s)",
    ]
    assert await apply(tmp_path, CATALOG, nats_url) == 0
    assert capsys.readouterr().out == "no changes\n"
    assert (await js.stream_info(s.EVENTS_STREAM)).state.last_seq == 4

    edited = CATALOG.replace("replicas: 2", "replicas: 3").replace(
        "  - name: qwen\n    fallbacks: [llama]\n", ""
    )
    assert await apply(tmp_path, edited, nats_url) == 0
    assert capsys.readouterr().out.splitlines() == [
        "model llama: changed (replicas)",
        "model qwen: removed",
        "applied 2 change(s)",
    ]
    assert (await log_types(js))[4:] == ["ModelDeclared:llama", "ModelRemoved:qwen"]
    assert await apply(tmp_path, edited, nats_url) == 0
    assert capsys.readouterr().out == "no changes\n"


async def test_a_concurrent_change_to_the_same_entry_is_refused(js, nats_url, tmp_path, capsys):
    await bus.provision(js)
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    cat = apply_cli.load_file(str(path))
    nc = await bus.connect(nats_url, "t")
    try:
        stale = await apply_cli.read_current(nc.jetstream())
        # Someone else declares llama between our read and our publish.
        await bus.publish(js, c.ModelDeclared(name="llama", replicas=9))
        real_read = apply_cli.read_current

        async def read_stale(_js, _api=None):
            return stale

        apply_cli.read_current = read_stale
        try:
            await apply_cli._apply(cat, nats_url, False)
        except apply_cli.ApplyError as exc:
            assert "the catalog changed while applying" in str(exc)
        else:
            raise AssertionError("a stale apply overwrote a concurrent change")
        finally:
            apply_cli.read_current = real_read
    finally:
        await nc.close()


def test_cli_reports_every_problem_with_its_entry_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "models:\n  - name: ok\n  - name: llama\n    profile: {gpus_per_shard: two}\n"
        "tenants:\n  - {name: t, band: nope}\n"
    )
    res = subprocess.run(
        procs.llmgw_argv("apply", "-f", str(path), "--nats", "nats://127.0.0.1:1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f"{path}: models[1] (name=llama): profile.gpus_per_shard: expected int, got 'two'",
        f"{path}: tenants[0] (name=t): band: 'nope' is not a declared band (none declared)",
    ]


async def test_apply_says_when_nats_is_unreachable(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("models: [{name: m}]")
    try:
        await asyncio.wait_for(
            apply_cli._apply(apply_cli.load_file(str(path)), "nats://127.0.0.1:1", False), 20
        )
    except apply_cli.ApplyError as exc:
        assert "cannot reach NATS at nats://127.0.0.1:1" in str(exc)
    else:
        raise AssertionError("apply succeeded without NATS")
