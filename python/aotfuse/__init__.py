"""aotfuse: memory-efficient fusion for PyTorch training.

    >>> from aotfuse import memory_efficient_fusion
    >>> aot_model = memory_efficient_fusion(model)
"""
from __future__ import annotations

import torch  # noqa: F401  (the C core's bridge needs torch loaded)

from . import _C
from ._C import Error
from .compile import (AOTDataParallel, AOTModule, CaptureError, HooksError, ObjectInputError, aot_function, aot_module,
                      memory_efficient_fusion)
from .decompositions import default_decompositions
from .explain import explain
from .lower import UnsupportedError
from .partition import default_partition, min_cut_rematerialization_partition

__version__ = "0.1.0"

__all__ = [
    "memory_efficient_fusion",
    "aot_function",
    "aot_module",
    "explain",
    "min_cut_rematerialization_partition",
    "default_partition",
    "default_decompositions",
    "AOTDataParallel",
    "AOTModule",
    "CaptureError",
    "HooksError",
    "ObjectInputError",
    "UnsupportedError",
    "Error",
]

from .dynamo import _register as _register_dynamo_backend

_register_dynamo_backend()
