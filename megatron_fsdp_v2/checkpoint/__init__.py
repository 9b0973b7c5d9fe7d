"""Everything about saving and loading a wrapped model: sharded DCP state dicts (state_dict.py),
atomic save / load, asynchronous save and full export (save_load.py), the on-disk chunk format
(dcp_format.py), checksums (integrity.py), a reader that never unpickles outside torch's
allow-list (safe_reader.py), crash-safe directory commits (commit.py), host copies for an
asynchronous save (staging.py), its writer thread and gloo group (background.py), and errors
raised on every rank (errors.py, collective_errors.py). Imports run one way: errors <-
collective_errors <- dcp_format <- integrity <- safe_reader / commit / staging / background <-
state_dict <- save_load."""

from .errors import CheckpointCorruptError, UnsafeCheckpointError
from .integrity import ChecksummedFileSystemWriter
from .safe_reader import SafeFileSystemReader
from .save_load import async_save_checkpoint, export_full_state_dict, load_checkpoint, save_checkpoint
from .staging import HostStager
from .state_dict import load_model_state_dict, load_optimizer_state_dict, model_state_dict, optimizer_state_dict

__all__ = ["CheckpointCorruptError", "ChecksummedFileSystemWriter", "HostStager", "SafeFileSystemReader",
           "UnsafeCheckpointError", "async_save_checkpoint", "export_full_state_dict", "load_checkpoint",
           "load_model_state_dict", "load_optimizer_state_dict", "model_state_dict", "optimizer_state_dict",
           "save_checkpoint"]
