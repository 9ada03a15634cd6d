"""Distributed checkpoints: sharded, atomic, resharding on load, for every axond wrapper.

    model_sd, optim_sd = axond.checkpoint.get_state_dict(model, optimizer)
    axond.checkpoint.save({"model": model_sd, "optim": optim_sd}, path)      # every rank calls it
    sd = {"model": model_sd, "optim": optim_sd}; axond.checkpoint.load(sd, path)
    axond.checkpoint.set_state_dict(model, optimizer, sd["model"], sd["optim"])

See docs/checkpoint.md for the layout, resharding and atomicity.
"""

from axond.checkpoint.api import load, save
from axond.checkpoint.async_save import async_save
from axond.checkpoint.export import export, load_full
from axond.checkpoint.metadata import CheckpointError
from axond.checkpoint.sharded import Chunk, ShardedTensor
from axond.checkpoint.state import get_state_dict, set_state_dict
from axond.checkpoint.storage import latest, read_metadata

__all__ = [
    "CheckpointError", "Chunk", "ShardedTensor", "async_save", "export", "get_state_dict", "latest", "load",
    "load_full", "read_metadata", "save", "set_state_dict",
]
