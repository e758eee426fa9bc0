"""Environment configuration, read when used (so tests can change it).

AOTFUSE_DISABLE=1      run every compiled function eagerly (for bisecting)
AOTFUSE_LOG=a,b        log stages: partition, lowering, fusion, codegen, cache (and "all")
AOTFUSE_CACHE_SIZE=N   compiled signatures kept per function (default 8)
AOTFUSE_CHECK_INPUTS=0 skip the C runtime's check of each input against the program
AOTFUSE_FUSION=0       no fused kernels: every node runs as an extern ATen call
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("aotfuse")


def disabled() -> bool:
    return os.environ.get("AOTFUSE_DISABLE", "0") not in ("", "0")


def logs(stage: str) -> bool:
    wanted = {s.strip() for s in os.environ.get("AOTFUSE_LOG", "").split(",") if s.strip()}
    return stage in wanted or "all" in wanted


def cache_size() -> int:
    try:
        return max(1, int(os.environ.get("AOTFUSE_CACHE_SIZE", "8")))
    except ValueError:
        return 8


def check_inputs() -> bool:
    return os.environ.get("AOTFUSE_CHECK_INPUTS", "1") not in ("", "0")


def fusion() -> bool:
    return os.environ.get("AOTFUSE_FUSION", "1") not in ("", "0")


def emit(stage: str, message: str) -> None:
    """Prints a log line for `stage` when AOTFUSE_LOG asks for it."""
    if logs(stage):
        if not log.handlers and not logging.getLogger().handlers:
            logging.basicConfig(format="[aotfuse] %(message)s")
        log.warning("%s: %s", stage, message)
