"""Reading a checkpoint that may come from anyone, with nothing in it run.

Checkpoints move between people and clusters, and DCP reads them with pickle: ``.metadata``
with the plain unpickler, and each non-tensor entry (the optimizer's ``param_groups``) with
``torch.load`` allowed to unpickle anything. Either runs whatever a crafted file names. Here ``.metadata``
goes through an unpickler that resolves only the names a real one holds (DCP's metadata classes,
``torch.Size``, dtypes, the layout helper, ``pathlib`` paths), and the entries through torch's
weights-only unpickler. Anything else is refused in one line, before it is called.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ppsplit.errors import PpsplitError

_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch._utils": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}


class UnsafeCheckpoint(PpsplitError):
    """A checkpoint file names something that a checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, folder: str):
        super().__init__(file)
        self.folder = folder

    def find_class(self, module: str, name: str):
        allowed = name in _METADATA_NAMES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpoint(f"checkpoint.load={self.folder!r}: its .metadata names {module}.{name}, which "
                                   "a checkpoint's metadata never holds; nothing of it was run; allowed: "
                                   "torch.distributed.checkpoint's metadata classes, torch.Size, dtypes, paths")
        return super().find_class(module, name)


def read_metadata(folder: str, name: str = ".metadata") -> Metadata:
    """The checkpoint's DCP metadata, read without running anything."""
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, folder).load()
    except UnsafeCheckpoint:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise PpsplitError(f"checkpoint.load={folder!r}: its .metadata cannot be read "
                           f"({type(err).__name__}); allowed: a checkpoint ppsplit wrote") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"checkpoint.load={folder!r}: its .metadata holds a {type(metadata).__name__}, "
                               "not DCP's Metadata; allowed: a checkpoint ppsplit wrote")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, its metadata read by :func:`read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")  # DCP's fallback: a rank's own metadata, read alike
        metadata = read_metadata(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor entries read by torch's weights-only unpickler."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(f"checkpoint entry {read_item.dest_index.fqn!r} holds more than plain values "
                                   f"({str(err).splitlines()[0][:160]}); nothing of it was run") from None
        if self.flatten_state_dict:
            from ppsplit.torch_private import set_nested

            set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
