"""Everything that touches DeepSpeed ZeRO internals; every DeepSpeed name it uses is declared in seams.py."""

from .optimizer import install
from .packed import PackedPartitions
from .partition import PartitionLayout, partition_layout
from .report import StorageReport
from .seams import SEAMS, UnsupportedDeepSpeed, check_version
from .wire import WireFormat, wire_format

__all__ = ["SEAMS", "PackedPartitions", "PartitionLayout", "StorageReport", "UnsupportedDeepSpeed", "WireFormat",
           "check_version", "install", "partition_layout", "wire_format"]
