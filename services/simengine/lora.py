"""LoRA adapters in the simulator, modelled on vLLM's: names, slots, load time, answers.

vLLM keeps two sets. Adapters *registered* through POST /v1/load_lora_adapter are
served under their names (requests name them as `model`) until unloaded; there is no
limit on them. Adapters *resident* in the engine number at most `max_loras` here (vLLM's
CPU cache, `--max-cpu-loras`, which defaults to `--max-loras`): a request for a
registered adapter that is not resident loads it from its path first, evicting the
least recently used one, and waits for the load. So the cost of spreading many
adapters over few slots shows as loads and as time to first token, which is what a
placement that keeps each adapter on a few replicas saves.

`on_demand` is the benchmark's baseline: any adapter name is served, registered on its
first request (no path needed), so traffic may land anywhere and pay a load there.

The status codes and error bodies are vLLM 0.32's (docs/simengine.md lists them). A
simplification: an evicted adapter's running requests go on as if it were resident.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from collections.abc import Callable

from llmgw.simengine.protocol import ApiError


def _already_loaded(name: str) -> ApiError:
    return ApiError(
        400,
        f"The lora adapter '{name}' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        type="InvalidUserInput",
        code=400,
    )


class Adapters:
    """The engine's adapters. Owned by the app; `acquire` is awaited by a request's
    handler, so a load's time passes while its requests wait, as in vLLM."""

    def __init__(
        self,
        base: str,
        max_loras: int,
        load_seconds: float = 0.0,
        *,
        max_rank: int = 16,
        on_demand: bool = False,
        path_exists: Callable[[str], bool] = os.path.exists,
    ):
        self.base = base  # the served name adapters list as their parent
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.load_seconds = load_seconds
        self.on_demand = on_demand
        self._path_exists = path_exists
        self.registered: dict[str, str] = {}  # name -> path, in load order
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Future] = {}
        self.loads = 0  # adapters brought into a slot (by the API or by a request)
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def serves(self, name: str) -> bool:
        """Whether a request may name `name` as its model."""
        return self.enabled and (name in self.registered or self.on_demand)

    # -- the API -------------------------------------------------------------------------

    async def load(self, name: str | None, path: str | None, inplace: bool = False) -> str:
        """POST /v1/load_lora_adapter; the success text, or ApiError with vLLM's answer."""
        self._check_enabled()
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not value:
                raise ApiError(
                    400, f"body.{field}: Field required", type="Bad Request", param=f"body.{field}"
                )
        if name in self.registered and not inplace:
            raise _already_loaded(name)
        if not self._path_exists(path):
            raise ApiError(
                404,
                f"Loading lora {name} failed: No adapter found for {path}",
                type="NotFoundError",
                code=404,
            )
        self._check_rank(name, path)
        self.registered[name] = path
        self.resident.pop(name, None)  # in place: the new weights are loaded now
        await self.acquire(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str | None) -> str:
        """POST /v1/unload_lora_adapter; the success text, or ApiError with vLLM's answer."""
        self._check_enabled()
        if not name:
            raise ApiError(
                400, "body.lora_name: Field required", type="Bad Request", param="body.lora_name"
            )
        if name not in self.registered:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError", code=404
            )
        del self.registered[name]
        self.resident.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_rank(self, name: str, path: str) -> None:
        """vLLM refuses an adapter of a rank above --max-lora-rank when it loads it, with a
        500 (its loader's error, passed on); the rank is in the adapter's config."""
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                rank = int(json.load(f).get("r", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return  # no readable config: the simulator loads no weights, so it serves anyway
        if rank > self.max_rank:
            raise ApiError(
                500,
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_rank}.",
                type="InternalServerError",
                code=500,
            )

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ApiError(
                400,
                "LoRA is not enabled: start the engine with --max-loras N (N > 0)",
                type="InvalidUserInput",
                code=400,
            )

    # -- requests ------------------------------------------------------------------------

    async def acquire(self, name: str) -> None:
        """Make `name` resident before its request runs: at once when it is, else after a
        load (one load per adapter, however many requests wait for it)."""
        if name not in self.registered:
            if not self.on_demand:
                # Unloaded since its request was parsed: the parser's answer for it.
                raise ApiError(
                    404,
                    f"The model `{name}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            self.registered[name] = name
        if name in self.resident:
            self.resident.move_to_end(name)
            return
        pending = self._loading.get(name)
        if pending is not None:
            await asyncio.shield(pending)
            return
        pending = self._loading[name] = asyncio.get_running_loop().create_future()
        try:
            if self.load_seconds:
                await asyncio.sleep(self.load_seconds)
            while len(self.resident) >= self.max_loras:
                self.resident.popitem(last=False)
                self.evictions += 1
            self.resident[name] = None
            self.loads += 1
        finally:
            del self._loading[name]
            pending.set_result(None)

    def models(self, created: int) -> list[dict]:
        """/v1/models entries for the registered adapters, as vLLM lists them."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in self.registered.items()
        ]
