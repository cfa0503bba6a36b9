"""What this node has: GPUs (from NVML, or a fake list for simulated nodes) and the host.

NVML is queried defensively: every optional query is guarded on its own, because
drivers, GPU generations and MIG or vGPU setups each lack some of them, and a
missing NVLink or topology answer must never keep a node from registering.

Fake GPUs (`--fake-gpus`): comma-separated groups `COUNTxSIZE[:NAME]`, SIZE being a
number with a unit of TiB, GiB, MiB, TB, GB or MB (`8x80GiB`, `2x141GB:H200,2x24GiB`).
Their UUIDs are `GPU-fake-<node>-<index>`: stable across agent restarts, so the
control plane sees the same GPUs when a simulated node re-registers.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw import contracts as c

log = logging.getLogger(__name__)

_UNITS = {
    "tib": 1 << 40,
    "gib": 1 << 30,
    "mib": 1 << 20,
    "tb": 10**12,
    "gb": 10**9,
    "mb": 10**6,
}
_GROUP = re.compile(
    r"^\s*(?P<count>\d+)\s*[xX]\s*(?P<size>\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z]+)\s*(?::(?P<name>.+))?$"
)


class InventoryError(RuntimeError):
    """No usable GPU inventory: the message says what is missing and how to fix it."""


@dataclass
class Inventory:
    gpus: dict[str, c.GpuInfo]  # by UUID
    host: c.HostInfo
    # NVML handle lookups for live queries (free memory, processes); empty for fake GPUs.
    probe: GpuProbe | None = field(default=None, repr=False)

    def by_index(self) -> list[c.GpuInfo]:
        return sorted(self.gpus.values(), key=lambda g: g.index)


def parse_fake_gpus(spec: str, node: str) -> list[c.GpuInfo]:
    gpus: list[c.GpuInfo] = []
    for group in spec.split(","):
        m = _GROUP.match(group)
        if not m:
            raise InventoryError(
                f"fake_gpus: {group.strip()!r} is not COUNTxSIZE[:NAME] (e.g. 8x80GiB)"
            )
        unit = _UNITS.get(m["unit"].lower())
        if unit is None:
            raise InventoryError(
                f"fake_gpus: unit {m['unit']!r} in {group.strip()!r} is not one of "
                "TiB, GiB, MiB, TB, GB, MB"
            )
        count = int(m["count"])
        if count < 1:
            raise InventoryError(f"fake_gpus: {group.strip()!r} has no GPUs")
        memory = int(float(m["size"]) * unit)
        name = (m["name"] or "Fake GPU").strip()
        for _ in range(count):
            i = len(gpus)
            gpus.append(
                c.GpuInfo(
                    uuid=f"GPU-fake-{node}-{i}",
                    index=i,
                    name=name,
                    memory_bytes=memory,
                    pci_bus_id=f"00000000:{i + 1:02X}:00.0",
                )
            )
    return gpus


def host_info(address: str) -> c.HostInfo:
    memory = 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return c.HostInfo(
        hostname=socket.gethostname(),
        cpu_count=os.cpu_count() or 0,
        memory_bytes=memory,
        os=platform.platform(),
        address=address,
    )


# ---------------------------------------------------------------- NVML


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _guard(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one optional NVML query; None (and a debug line) when it is not supported."""
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError_NotSupported, missing symbols in old drivers, ...
        log.debug("nvml %s unavailable: %s", what, exc)
        return None


def _cuda_version(nvml: Any) -> str:
    v = _guard("cuda version", nvml.nvmlSystemGetCudaDriverVersion_v2)
    if v is None:
        v = _guard("cuda version", nvml.nvmlSystemGetCudaDriverVersion)
    return f"{v // 1000}.{(v % 1000) // 10}" if isinstance(v, int) and v > 0 else ""


def _topology_word(nvml: Any, level: int) -> str:
    words = {
        "NVML_TOPOLOGY_INTERNAL": "X",
        "NVML_TOPOLOGY_SINGLE": "PIX",
        "NVML_TOPOLOGY_MULTIPLE": "PXB",
        "NVML_TOPOLOGY_HOSTBRIDGE": "PHB",
        "NVML_TOPOLOGY_NODE": "NODE",
        "NVML_TOPOLOGY_SYSTEM": "SYS",
    }
    for const, word in words.items():
        if getattr(nvml, const, object()) == level:
            return word
    return str(level)


def _nvlink_peer(nvml: Any, a: Any, b: Any) -> bool:
    """P2P over NVLink, which also holds through NVSwitch (where remote PCI ids are switches)."""
    status = _guard(
        "p2p nvlink status", nvml.nvmlDeviceGetP2PStatus, a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK
    )
    return status is not None and status == nvml.NVML_P2P_STATUS_OK


def _has_active_nvlink(nvml: Any, handle: Any) -> bool:
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _guard("nvlink state", nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break  # links are numbered densely; the first unsupported one ends the list
        if state:
            return True
    return False


class GpuProbe:
    """Live NVML queries used when validating a launch (free memory, busy GPUs)."""

    def __init__(self, nvml: Any, handles: dict[str, Any]):
        self._nvml = nvml
        self._handles = handles

    def free_memory(self, uuid: str) -> int | None:
        h = self._handles.get(uuid)
        info = None if h is None else _guard("memory", self._nvml.nvmlDeviceGetMemoryInfo, h)
        return None if info is None else int(info.free)

    def process_count(self, uuid: str) -> int | None:
        h = self._handles.get(uuid)
        if h is None:
            return None
        procs = _guard("compute processes", self._nvml.nvmlDeviceGetComputeRunningProcesses, h)
        return None if procs is None else len(procs)


def nvml_inventory(address: str, nvml: Any | None = None) -> Inventory:
    """Read GPUs through NVML; raises the NVML error when there is no driver or library."""
    if nvml is None:
        import pynvml as nvml  # nvidia-ml-py
    nvml.nvmlInit()
    host = host_info(address)
    host.driver_version = _text(_guard("driver version", nvml.nvmlSystemGetDriverVersion) or "")
    host.cuda_version = _cuda_version(nvml)
    count = nvml.nvmlDeviceGetCount()
    handles: dict[str, Any] = {}
    gpus: dict[str, c.GpuInfo] = {}
    for index in range(count):
        h = _guard("handle", nvml.nvmlDeviceGetHandleByIndex, index)
        uuid = None if h is None else _guard("uuid", nvml.nvmlDeviceGetUUID, h)
        if uuid is None:
            log.warning("GPU at NVML index %d cannot be read; it is left out", index)
            continue
        uuid = _text(uuid)
        mem = _guard("memory", nvml.nvmlDeviceGetMemoryInfo, h)
        pci = _guard("pci info", nvml.nvmlDeviceGetPciInfo, h)
        cc = _guard("compute capability", nvml.nvmlDeviceGetCudaComputeCapability, h)
        mig = _guard("mig mode", nvml.nvmlDeviceGetMigMode, h)
        gpus[uuid] = c.GpuInfo(
            uuid=uuid,
            index=index,
            name=_text(_guard("name", nvml.nvmlDeviceGetName, h) or ""),
            memory_bytes=int(mem.total) if mem is not None else 0,
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else "",
            mig_mode=None if not mig else mig[0] == nvml.NVML_DEVICE_MIG_ENABLE,
        )
        handles[uuid] = h
    linked = {u for u, h in handles.items() if _has_active_nvlink(nvml, h)}
    for u, h in handles.items():
        for v, other in handles.items():
            if u == v:
                continue
            if u in linked and v in linked and _nvlink_peer(nvml, h, other):
                gpus[u].nvlink_peers.append(v)
                gpus[u].topology[v] = "NV"
                continue
            level = _guard("topology", nvml.nvmlDeviceGetTopologyCommonAncestor, h, other)
            if level is not None:
                gpus[u].topology[v] = _topology_word(nvml, level)
    return Inventory(gpus=gpus, host=host, probe=GpuProbe(nvml, handles))


def _no_driver_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    # LibraryNotFound and DriverNotLoaded are the usual ones; any NVML failure at init
    # (no permission, GPU lost) equally leaves us without an inventory.
    return (getattr(nvml, "NVMLError", OSError),)


def discover(node: str, fake_gpus: str, address: str, nvml: Any | None = None) -> Inventory:
    """Real GPUs through NVML, or the `fake_gpus` inventory for a simulated node.

    A configured fake inventory wins (a simulated node on a GPU machine stays simulated).
    Raises InventoryError when neither gives any GPU.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
            nvml = None
    real: Inventory | None = None
    no_driver = "nvidia-ml-py is not installed"
    if nvml is not None:
        try:
            real = nvml_inventory(address, nvml)
        except _no_driver_errors(nvml) as exc:
            no_driver = str(exc)
    if fake_gpus:
        gpus = parse_fake_gpus(fake_gpus, node)
        if real is None:
            log.info("no NVIDIA driver (%s): using the fake GPU inventory %s", no_driver, fake_gpus)
        else:
            log.warning(
                "NVML sees %d GPUs, but fake_gpus is set: using the fake inventory %s",
                len(real.gpus),
                fake_gpus,
            )
        host = host_info(address)
        host.fake_gpus = True
        return Inventory(gpus={g.uuid: g for g in gpus}, host=host)
    if real is None:
        raise InventoryError(
            f"no GPUs: NVML reports {no_driver!r} and no fake GPU inventory was given "
            "(for a simulated node pass e.g. --fake-gpus 8x80GiB)"
        )
    if not real.gpus:
        raise InventoryError(
            "no GPUs: NVML found none on this node and no fake GPU inventory was given"
        )
    return real
