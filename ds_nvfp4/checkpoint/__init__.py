"""What ds_nvfp4 writes beside DeepSpeed's checkpoint files, and how it reads checkpoints back (no DeepSpeed
import at module load)."""

from .metadata import FILE, SCHEMA_VERSION, CheckpointError, CheckpointMetadata, read_metadata, write_metadata

__all__ = ["FILE", "SCHEMA_VERSION", "CheckpointError", "CheckpointMetadata", "read_metadata", "write_metadata"]
