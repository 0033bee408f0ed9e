"""The machine a benchmark ran on, printed beside its numbers: absolute times mean little without it."""

from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe(backend: str | None = None) -> str:
    """e.g. "x86_64, 2 cores (AMD EPYC), torch 2.13.0+cpu, transformers 5.24.0, gloo"."""
    import torch
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [
        platform.machine(),
        f"{cores} cores ({_cpu_model()})",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    return "machine: " + ", ".join(parts + ([backend] if backend else []))
