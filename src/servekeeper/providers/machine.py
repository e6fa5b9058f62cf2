"""What this machine has, for placement (core/placement.py judges; this only looks)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

from servekeeper.core.placement import Capacity


def gpu_count() -> int:
    """NVIDIA GPUs (device files), limited by CUDA_VISIBLE_DEVICES as Ray limits them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def machine_capacity() -> Capacity:
    return Capacity(gpus=gpu_count(), memory_bytes=psutil.virtual_memory().total)
