"""The per-request guard: deadlines by phase, moved lazily, and nothing after close."""

import asyncio

from llmgw.router.request.guard import Guard


async def never(message_type="http.request"):
    await asyncio.sleep(3600)


async def run_guarded(body, watch_after=10.0, receive=never):
    """Run body(guard) in a task; return (what it returned or 'cancelled', guard)."""
    holder = {}

    async def main():
        guard = Guard(asyncio.get_running_loop(), asyncio.current_task(), receive, watch_after)
        holder["guard"] = guard
        try:
            return await body(guard)
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            guard.close()

    result = await asyncio.wait_for(asyncio.create_task(main()), 5)
    return result, holder["guard"]


async def test_a_passed_deadline_cancels_the_task_naming_its_phase():
    async def body(guard):
        guard.arm("first_token", 0.02)
        await asyncio.sleep(1)

    result, guard = await run_guarded(body)
    assert result == "cancelled" and guard.fired == "first_token"


async def test_pushing_the_idle_deadline_later_keeps_a_steady_stream_alive():
    async def body(guard):
        for _ in range(10):
            # 0.5 s in all, twice the deadline; each gap leaves 0.2 s of slack, as a short
            # sleep can overrun by tens of ms on a loaded box.
            guard.arm("idle", 0.25)
            await asyncio.sleep(0.05)
        return "done"

    result, guard = await run_guarded(body)
    assert result == "done" and guard.fired is None


async def test_the_total_deadline_wins_when_it_comes_first():
    async def body(guard):
        guard.total_at = asyncio.get_running_loop().time() + 0.02
        guard.arm("idle", 10)
        await asyncio.sleep(1)

    result, guard = await run_guarded(body)
    assert guard.fired == "total"


async def test_a_client_that_leaves_cancels_the_task_once_watched():
    async def gone():
        return {"type": "http.disconnect"}

    async def body(guard):
        await asyncio.sleep(1)

    result, guard = await run_guarded(body, watch_after=0.01, receive=gone)
    assert result == "cancelled" and guard.client_gone and guard.fired is None


async def test_nothing_fires_after_close():
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(asyncio.sleep(0.1))
    guard = Guard(loop, task, never, 0.0)
    guard.arm("headers", 0.0)
    guard.close()
    await task  # not cancelled
    assert guard.fired is None


async def test_a_body_read_past_its_deadline_cancels_the_task_naming_body_read():
    async def body(guard):
        guard.reading(0.02)
        await asyncio.sleep(1)

    result, guard = await run_guarded(body, watch_after=0.0)
    assert result == "cancelled" and guard.fired == "body_read"


async def test_the_watcher_waits_for_the_body_then_watches_the_client():
    calls = []

    async def gone():
        calls.append(1)
        return {"type": "http.disconnect"}

    async def body(guard):
        guard.reading(10)
        await asyncio.sleep(0.05)  # past watch_after: the body read still owns receive()
        assert calls == []
        guard.read_done()
        await asyncio.sleep(1)

    result, guard = await run_guarded(body, watch_after=0.01, receive=gone)
    assert result == "cancelled" and guard.client_gone and guard.fired is None


async def test_the_guard_context_turns_its_own_cancel_into_one_deadline_error():
    from llmgw.router.request.guard import DeadlinePassed

    async def body(guard):
        try:
            with guard:
                guard.arm("idle", 0.02)
                await asyncio.sleep(1)
        except DeadlinePassed as passed:
            # The task is usable again: it can await, and its deadline flag is reset.
            await asyncio.sleep(0)
            return passed.phase, asyncio.current_task().cancelling(), guard.fired
        return "not interrupted"

    result, _ = await run_guarded(body)
    assert result == ("idle", 0, None)


async def test_the_guard_context_reports_a_client_that_left_as_client_gone():
    from llmgw.router.request.guard import ClientGone

    async def leaves():
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def body(guard):
        try:
            with guard:
                await asyncio.sleep(1)
        except ClientGone:
            return "gone", asyncio.current_task().cancelling()
        return "stayed"

    result, _ = await run_guarded(body, watch_after=0.0, receive=leaves)
    assert result == ("gone", 0)


async def test_a_cancel_the_guard_did_not_cause_passes_through_its_context():
    async def body(guard):
        with guard:
            asyncio.current_task().cancel()  # the server stopping, say
            await asyncio.sleep(1)
        return "swallowed"

    result, guard = await run_guarded(body)
    assert result == "cancelled"
