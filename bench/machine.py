"""What the benchmarks ran on: the machine's name for file names and tables (the GPU's, or
the CPU model and core count), and the versions that matter."""

from __future__ import annotations

import os
import platform
import re

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def describe(device: torch.device) -> dict:
    """A JSON-able description of the machine; ``name`` is file-name safe."""
    cores = os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    name = slug(gpu) if gpu else f"cpu-{slug(cpu_model())}-{cores}c"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "name": name,
        "title": gpu or f"{cpu_model()}, {cores} cores (no GPU)",
        "gpu": gpu,
        "cpu": cpu_model(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        "memory_gib": memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda if gpu else None,
        "platform": platform.platform(),
    }
