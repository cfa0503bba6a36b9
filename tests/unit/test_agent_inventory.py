"""Inventory: fake GPU specs, and NVML reading that survives every unsupported query."""

from types import SimpleNamespace

import pynvml
import pytest

from llmgw.agent.inventory import InventoryError, discover, nvml_inventory, parse_fake_gpus

GiB = 1 << 30
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def test_fake_gpus_spec():
    gpus = parse_fake_gpus("2x80GiB, 1x141GB:H200", "n1")
    assert [(g.uuid, g.index, g.name, g.memory_bytes) for g in gpus] == [
        ("GPU-fake-n1-0", 0, "Fake GPU", 80 * GiB),
        ("GPU-fake-n1-1", 1, "Fake GPU", 80 * GiB),
        ("GPU-fake-n1-2", 2, "H200", 141 * 10**9),
    ]
    assert len({g.pci_bus_id for g in gpus}) == 3
    # Stable across restarts: the same node gets the same UUIDs.
    assert parse_fake_gpus("2x80GiB", "n1")[1].uuid == gpus[1].uuid


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("8", "is not COUNTxSIZE"),
        ("8x80", "is not COUNTxSIZE"),
        ("8x80PB", "unit 'PB'"),
        ("0x80GiB", "has no GPUs"),
        ("8x80GiB,", "is not COUNTxSIZE"),
    ],
)
def test_bad_fake_gpu_specs_are_named(spec, reason):
    with pytest.raises(InventoryError, match=reason):
        parse_fake_gpus(spec, "n1")


class FakeNvml:
    """pynvml's surface for four GPUs with uneven support; a fifth cannot be read at all."""

    NVMLError = pynvml.NVMLError
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_NVLINK_MAX_LINKS = 18
    NVML_TOPOLOGY_NODE = pynvml.NVML_TOPOLOGY_NODE
    NVML_TOPOLOGY_SYSTEM = pynvml.NVML_TOPOLOGY_SYSTEM

    def __init__(self, init_error=None):
        self.init_error = init_error

    def _unsupported(self, *args):
        raise pynvml.NVMLError(NOT_SUPPORTED)

    def nvmlInit(self):
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return 5

    def nvmlDeviceGetHandleByIndex(self, i):
        if i == 4:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200" if h != 3 else b"NVIDIA A10"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=141 * GiB, free=100 * GiB, used=41 * GiB)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h + 0x18:02X}:00.0".encode())

    def nvmlDeviceGetCudaComputeCapability(self, h):
        if h == 3:
            self._unsupported()
        return (9, 0)

    def nvmlDeviceGetMigMode(self, h):
        if h == 3:
            self._unsupported()
        return (1 if h == 2 else 0, 0)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 3 or link >= 2:
            self._unsupported()
        return 1 if h in (0, 1) else 0

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return pynvml.NVML_P2P_STATUS_OK if {a, b} == {0, 1} else 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        if 3 in (a, b):
            self._unsupported()
        return pynvml.NVML_TOPOLOGY_NODE if {a, b} <= {0, 1, 2} else pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [object()] if h == 1 else []


def test_nvml_inventory_reads_what_each_gpu_supports():
    inv = nvml_inventory("10.0.0.7", FakeNvml())
    assert sorted(inv.gpus) == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]  # the lost GPU is left out
    assert inv.host.driver_version == "550.54.15" and inv.host.cuda_version == "12.4"
    assert inv.host.address == "10.0.0.7" and not inv.host.fake_gpus
    g0, g2, g3 = inv.gpus["GPU-0"], inv.gpus["GPU-2"], inv.gpus["GPU-3"]
    assert g0.name == "NVIDIA H200" and g0.memory_bytes == 141 * GiB
    assert g0.pci_bus_id == "00000000:18:00.0" and g0.compute_capability == "9.0"
    assert g0.nvlink_peers == ["GPU-1"] and g0.topology == {"GPU-1": "NV", "GPU-2": "NODE"}
    assert g0.mig_mode is False and g2.mig_mode is True
    assert g2.topology == {"GPU-0": "NODE", "GPU-1": "NODE"}
    # Unsupported queries leave blanks, never an exception.
    assert g3.name == "NVIDIA A10" and g3.compute_capability == "" and g3.mig_mode is None
    assert g3.nvlink_peers == [] and g3.topology == {}
    assert inv.probe.free_memory("GPU-0") == 100 * GiB
    assert inv.probe.process_count("GPU-1") == 1 and inv.probe.process_count("GPU-0") == 0
    assert inv.probe.free_memory("GPU-nope") is None


def test_without_a_driver_the_fake_inventory_is_used():
    inv = discover("n1", "2x80GiB", "127.0.0.1", FakeNvml(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert sorted(inv.gpus) == ["GPU-fake-n1-0", "GPU-fake-n1-1"] and inv.host.fake_gpus
    assert inv.probe is None


def test_without_a_driver_or_fake_gpus_the_agent_refuses():
    with pytest.raises(InventoryError, match="--fake-gpus 8x80GiB"):
        discover("n1", "", "127.0.0.1", FakeNvml(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))


def test_a_configured_fake_inventory_wins_over_real_gpus():
    inv = discover("n1", "1x24GiB", "127.0.0.1", FakeNvml())
    assert list(inv.gpus) == ["GPU-fake-n1-0"]


def test_real_gpus_when_no_fake_inventory_is_configured():
    assert len(discover("n1", "", "127.0.0.1", FakeNvml()).gpus) == 4
