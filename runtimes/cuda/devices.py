"""GPUs as the planner and the cost model see them: memory, architecture and throughput of a few NVIDIA devices.

The cuda backend describes the GPU it runs on (``describe``: a known model by name, else the figures CUDA reports);
without a GPU, ``inspect --runtime cuda`` plans for a described device (``--device``, default the H200) and says
which. ``machine()`` gives the compiler's cost constants; ``CudaOptions``'s attention choice uses the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from luminal_recipes.errors import LuminalError
from luminal_recipes.runtimes.kernels import Machine

GIB = 1 << 30


@dataclass(frozen=True)
class GpuDescription:
    key: str  # what --device takes
    name: str  # as CUDA names it
    arch: str  # sm_XY
    memory: int  # bytes of device memory
    sms: int
    bytes_per_s: float  # sustained memory bandwidth
    tensor_flops: float  # bf16 GEMM (tensor cores, f32 accumulation), sustained
    simt_flops: float  # f32 FMA on the CUDA cores

    @property
    def label(self) -> str:
        return f"{self.name} ({self.arch}, {self.memory / GIB:.0f} GiB)"

    def machine(self) -> Machine:
        """Cost-model constants: a launch, memory bandwidth, SIMT arithmetic, tensor-core matrix products."""
        return Machine(launch_s=5e-6, bytes_per_s=self.bytes_per_s, ew_flops_per_s=self.simt_flops,
                       mm_flops_per_s=self.tensor_flops)


# sustained figures (about 75-80% of the data sheets'): H200's bf16 GEMM measured at ~790 TFLOP/s
DEVICES: dict[str, GpuDescription] = {d.key: d for d in (
    GpuDescription("h200", "NVIDIA H200", "sm_90", 141 * GIB, 132, 3.5e12, 600e12, 30e12),
    GpuDescription("h100", "NVIDIA H100 80GB HBM3", "sm_90", 80 * GIB, 132, 2.6e12, 600e12, 30e12),
    GpuDescription("b200", "NVIDIA B200", "sm_100", 180 * GIB, 148, 6.0e12, 1500e12, 45e12),
    GpuDescription("a100", "NVIDIA A100-SXM4-80GB", "sm_80", 80 * GIB, 108, 1.6e12, 230e12, 15e12),
    GpuDescription("l40s", "NVIDIA L40S", "sm_89", 48 * GIB, 142, 0.7e12, 280e12, 60e12),
    GpuDescription("rtx4090", "NVIDIA GeForce RTX 4090", "sm_89", 24 * GIB, 128, 0.8e12, 130e12, 60e12),
    # Turing: f16 tensor cores only; bf16 GEMMs (the recipes' compute dtype) run at its SIMT rate
    GpuDescription("t4", "Tesla T4", "sm_75", 15 * GIB, 40, 0.24e12, 6e12, 6e12),
)}
DEFAULT_DEVICE = "h200"


def device_description(key: str | None) -> GpuDescription:
    """The described GPU named ``key`` (``--device``; default the H200)."""
    key = (key or DEFAULT_DEVICE).lower()
    if key not in DEVICES:
        raise LuminalError(f"--device {key}: no description of that GPU; known: {', '.join(DEVICES)}")
    return DEVICES[key]


def describe(props: dict, total_memory: int) -> GpuDescription:
    """The GPU CUDA reports (``cudaGetDeviceProperties``): a known model's figures with its reported memory, else
    figures derived from the properties (bandwidth from the memory clock and bus width)."""
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    arch = f"sm_{props['major']}{props['minor']}"
    sms = int(props["multiProcessorCount"])
    for d in DEVICES.values():
        if d.arch == arch and d.name.split()[1] in name.split():
            return GpuDescription(d.key, name, arch, total_memory, sms, d.bytes_per_s, d.tensor_flops, d.simt_flops)
    clock_hz = float(props.get("memoryClockRate", 1_500_000)) * 1e3
    bus_bytes = float(props.get("memoryBusWidth", 4096)) / 8
    simt = sms * 0.2e12
    tensor = sms * 2.5e12 if int(props["major"]) >= 8 else simt  # no bf16 tensor cores before sm_80
    return GpuDescription(name.lower().replace(" ", "-"), name, arch, total_memory, sms,
                          0.75 * 2 * clock_hz * bus_bytes, tensor, simt)
