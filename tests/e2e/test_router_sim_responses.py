"""The Responses API end to end: the openai SDK, a real `llmgw router` process, and
real sim engines that implement /v1/responses as vLLM serves it.

The stream ends with `event: response.completed` (or `.incomplete`) and no
`data: [DONE]`, which the
router must take as complete; a stored response is fetched from and deleted at the
engine that made it, whichever of the two that was.
"""

from __future__ import annotations

import openai
import pytest

from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    sims = [start_sim(model="m", itl_ms=1, ttft_ms=1) for _ in range(2)]
    eps = "\n".join(
        f"  - {{id: s{i}, url: '{s.url}', models: [m], engine: sim}}" for i, s in enumerate(sims)
    )
    body = (
        "log_level: warning\nadmission: {enabled: false}\n"
        "models: [{name: m, aliases: [m-latest]}]\n"
        f"endpoints:\n{eps}\n"
    )
    router = start_router(tmp_path_factory.mktemp("router"), body)
    try:
        yield router, sims
    finally:
        code = router.stop()
        for s in sims:
            s.stop()
        assert code == 0, router.log_tail()


def test_responses_streamed_and_not_then_retrieved_and_deleted(stack):
    router, _ = stack
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    made = client.responses.create(model="m-latest", input="hello there", max_output_tokens=8)
    # Stopped by max_output_tokens (incomplete) or not: either is a whole answer.
    assert made.status in ("completed", "incomplete") and made.output_text
    events = list(
        client.responses.create(model="m", input="hello", max_output_tokens=8, stream=True)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
    for _ in range(4):  # whichever engine made it, every time
        assert client.responses.retrieve(made.id).id == made.id
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
