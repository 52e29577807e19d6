"""checkpoint: save and load an engine by parameter name (being split into its parts; see save_load)."""
from .save_load import (BLOCK_BYTES, INDEX, MOMENTS, OPTIMIZER, OPTIMIZER_INDEX, SHARD_BYTES, STATE, WEIGHTS,
                        CheckpointError, load, load_state_dict, save, write_safetensors)

__all__ = ["save", "load", "load_state_dict", "CheckpointError", "write_safetensors", "MOMENTS", "WEIGHTS", "INDEX",
           "OPTIMIZER", "OPTIMIZER_INDEX", "STATE", "SHARD_BYTES", "BLOCK_BYTES"]
