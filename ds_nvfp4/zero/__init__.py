"""Everything that touches DeepSpeed ZeRO internals (the version guard is in guard.py)."""

from .guard import UnsupportedDeepSpeed, check_version
from .partition import PartitionLayout, partition_layout
from .store import NVFP4Store, StorageReport, install

__all__ = ["NVFP4Store", "PartitionLayout", "StorageReport", "UnsupportedDeepSpeed", "check_version", "install",
           "partition_layout"]
