"""Where this process runs, as recorded beside results whose floats or wall times depend on the machine."""

from __future__ import annotations

import os
from pathlib import Path


def machine() -> dict:
    """Where this process runs: the CPU's model name, torch's CPU kernel set (``ATEN_CPU_CAPABILITY``) and
    the GPU, if any. Recorded in each study run's study_time.json (wall times compare only on one machine)
    and in a codes file (float32 results, the codes of a tokenizing among them, differ across CPU kernels)."""
    import torch

    cpu = None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
    except OSError:  # not Linux: platform's name below
        pass
    if not cpu:
        import platform

        cpu = platform.processor() or platform.machine() or "unknown"
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def default_device(device: str | None = None) -> str:
    """``device`` when given, else CUDA when this machine has a GPU, else the CPU: the one default of every
    command and verb that runs a trained model (evaluate, load_encoder, features)."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
