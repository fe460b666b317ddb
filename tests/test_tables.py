"""The one table of GPU figures (and its lookup by device name) and the one table of byte allowances."""

import pytest

from lightning_remat.core import hardware
from lightning_remat.core.hardware import GPUS, gpu, match_gpu


@pytest.mark.parametrize("device_name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("AMD Instinct MI300X", "mi300x"),
    ("Some Future Accelerator", None),
])
def test_a_device_name_finds_its_row(device_name, key):
    assert match_gpu(device_name) == key


def test_lookup_by_name_is_case_insensitive_and_names_the_known_gpus():
    assert gpu(" H100 ") is GPUS["h100"]
    with pytest.raises(ValueError, match="unknown GPU 'h1000'.*h100"):
        gpu("h1000")
    assert gpu("a100").flops("bf16") == 312e12
    with pytest.raises(ValueError, match="no bf16 FLOP/s known for GPU 'v100'"):
        gpu("v100").flops("bf16")


def test_the_lookups_read_the_one_table():
    from lightning_remat.runtime.measuring.roofline import device_peaks, training_flops_per_second

    for name, spec in GPUS.items():
        assert spec.flops() == device_peaks("cuda", name).flops_per_second
        assert training_flops_per_second("cuda", name) == spec.flops() * hardware.TRAINING_EFFICIENCY
        assert spec.memory_bandwidth == device_peaks("cuda", name).bytes_per_second
    # The data-sheet figures the plans were priced with before the tables became one.
    assert (device_peaks("cuda", "h100").flops_per_second, device_peaks("cuda", "h200").bytes_per_second,
            hardware.gpu("gh200").host_link_bandwidth) == (989e12, 4.8e12, 400e9)
    assert hardware.TRAINING_EFFICIENCY == 0.4
    assert match_gpu("NVIDIA H100 PCIe") == "h100-pcie"
    assert device_peaks("cpu", "a100") == device_peaks("cuda", "a100")  # a named GPU prices any device as itself


def test_every_byte_allowance_is_named_in_one_table_with_its_old_value():
    from lightning_remat.core import allowances
    from lightning_remat.runtime.profiling import profile

    assert (allowances.DDP_REDUCER_ALLOWANCE, allowances.LIGHTNING_LOOP_ALLOWANCE, allowances.ACCELERATE_LOOP_ALLOWANCE,
            allowances.REAL_PROFILE_ALLOWANCE) == (1024, 1024, 2048, 65536)
    assert profile.DDP_REDUCER_ALLOWANCE == allowances.DDP_REDUCER_ALLOWANCE
