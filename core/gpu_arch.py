"""Which GPU generation a compute capability belongs to: the one place the playbook decides by architecture.

    >>> arch_family((10, 3))            # a DGX Station GB300
    'blackwell-datacenter'

Every choice made by GPU generation asks `arch_family` (or `device_family`, for a torch device) and
decides from the family, never from a literal capability: a gate written `== (10, 0)` would send a
GB300 (10.3) down the path of an unknown GPU. The families:

    family                 capability    examples
    older                  below 9.0     A100 (8.0), L40S and RTX 4090 (8.9)
    hopper                 9.x           H100, H200, GH200 (9.0)
    blackwell-datacenter   10.x          B200, GB200 (10.0), B300, GB300 (10.3)
    blackwell-consumer     12.x          RTX 50 series, RTX PRO 6000 Blackwell (12.0), DGX Spark GB10 (12.1)
    newer                  11.x, 13+     Jetson Thor (11.0), and anything later: not recognised

What separates the two Blackwells for this playbook: data-centre Blackwell has the tcgen05 tensor cores
(with tensor memory), 228 KB of shared memory and 64 resident warps per SM, as Hopper has; consumer
Blackwell has FP8 and MX block-scaled tensor-core instructions (`mma.sync ... kind::mxf8f6f4`) but
neither tcgen05 nor Hopper's wgmma, 100 KB of shared memory per SM (99 KB per block) and 48 resident
warps per SM (CUDA C++ Programming Guide, compute capabilities table). A "newer" GPU gets the choices
that assume nothing of it: PyTorch's defaults and the run-time probes.

Each gate and what it picks per family is listed in docs/troubleshooting.md ("Blackwell");
tests/blackwell_test.py checks every one at 8.0, 9.0, 10.0, 10.3 and 12.0. This module imports nothing
(setup_check uses it before torch is installed); `device_family` imports torch when called.
"""

from __future__ import annotations

OLDER = "older"
HOPPER = "hopper"
BLACKWELL_DATACENTER = "blackwell-datacenter"
BLACKWELL_CONSUMER = "blackwell-consumer"
NEWER = "newer"
BLACKWELL = (BLACKWELL_DATACENTER, BLACKWELL_CONSUMER)

FAMILY_NAMES = {OLDER: "before Hopper", HOPPER: "Hopper", BLACKWELL_DATACENTER: "Blackwell, datacenter",
                BLACKWELL_CONSUMER: "Blackwell, consumer", NEWER: "newer than this playbook knows"}


def arch_family(capability: tuple[int, int]) -> str:
    """The family of a GPU of compute capability (major, minor): one of the five above. Decided by the
    major version alone, so that every minor version of a generation (10.0 and 10.3) takes one path."""
    major = int(capability[0])
    if major < 9:
        return OLDER
    return {9: HOPPER, 10: BLACKWELL_DATACENTER, 12: BLACKWELL_CONSUMER}.get(major, NEWER)


def device_capability(device) -> tuple[int, int]:
    """(major, minor) of a CUDA device (torch.cuda.get_device_capability)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def device_family(device) -> str:
    """`arch_family` of a CUDA device."""
    return arch_family(device_capability(device))


def describe(capability: tuple[int, int]) -> str:
    """'Blackwell, datacenter, sm_103': the family and the compute capability, for logs and reports."""
    return f"{FAMILY_NAMES[arch_family(capability)]}, sm_{capability[0]}{capability[1]}"
