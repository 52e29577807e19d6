"""checkpoint: save and load a trained model by parameter name, streamed, written beside the target and renamed.

A checkpoint is a directory:

  model.safetensors (or model-0000K-of-0000N.safetensors + model.safetensors.index.json, as save_pretrained
                     shards them)  fp32 weights (or bf16 for export) under the model's own names; a tied weight
                     once, under its first name; persistent buffers (BatchNorm statistics) under theirs
  optimizer.safetensors           "<name>.exp_avg" and "<name>.exp_avg_sq" of every trained parameter, fp32 in
                                  every optimizer_state (bf16 widened, int8 dequantized); with int8 moments also
                                  "<name>.exp_avg.codes" (U8, the parameter's shape) and "<name>.exp_avg.absmax"
                                  (F32, one scale per quant8 block), and the same for exp_avg_sq: what the chunks
                                  hold (kernels/quant8.py), so an int8 engine resumes bit for bit (quantizing the
                                  fp32 values again would not give the same codes: the maps have no -1). An int8
                                  checkpoint's moments therefore take more disk than fp32's: values, codes, scales
  pstar_fx_state.json             step, loss scale, the last clip coefficient, the optimizer and schedule
                                  config, the RNG state, the package version
  config.json                     a Hugging Face model's config, so `from_pretrained(path)` loads the weights
  adapter_model.safetensors,      a `peft` model's adapter as `PeftModel.save_pretrained` writes it (adapters.py),
  adapter_config.json             in place of model.safetensors and config.json unless the save asks for `full`

It speaks parameter names, never chunk ids, so it loads at another budget, chunk size or placement (int8 moments
are quantized per parameter, so their codes and scales do not depend on the chunks either), and in another
optimizer_state: fp32 moments load rounded into bf16 and quantized into int8. Files are
written one tensor at a time from whichever tier holds it (a GPU tensor in blocks of BLOCK_BYTES through two
page-locked buffers, the copy of one overlapping the disk's write of the other: extra host memory two blocks), in
the safetensors format (an 8-byte header length, a JSON header of names, dtypes, shapes and offsets, then the
bytes), into a directory beside the target that is renamed into place once every file is synced: a crash mid-save
leaves the previous checkpoint whole. A folder of safetensors weights alone (e.g. from `save_pretrained`) loads
too, with zeroed moments and step 0.

The owner hands over its parts (`Parts`: the chunk store, the parameters' names and chunks, the loop state, ...);
the checkpoint never reads an engine's attributes. The files, in the order a save runs:

  state.py        Parts; which tensors a checkpoint holds (`_entries`) and how they load back (`apply`)
  safetensors.py  the format: writing, reading, GPU<->disk blocks, shards
  atomic.py       the directory beside the target, fsync, rename, recovery; the ranks' agreement
  adapters.py     a peft model's adapter: peft's keys of its tensors, adapter_config.json
  save_load.py    save, load, load_state_dict
"""
from .safetensors import (BLOCK_BYTES, INDEX, OPTIMIZER, OPTIMIZER_INDEX, SHARD_BYTES, STATE, WEIGHTS,
                          CheckpointError, write_safetensors)
from .save_load import load, load_state_dict, save
from .state import MOMENTS, Parts

__all__ = ["save", "load", "load_state_dict", "Parts", "CheckpointError", "write_safetensors", "MOMENTS",
           "WEIGHTS", "INDEX", "OPTIMIZER", "OPTIMIZER_INDEX", "STATE", "SHARD_BYTES", "BLOCK_BYTES"]
