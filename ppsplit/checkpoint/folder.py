"""Checkpoint folders: written so that nothing is ever half-written, and nothing of the user's is
ever deleted.

The ranks write into a staging folder beside ``checkpoint.dir``. Only when the run has passed
does the driver add ``ppsplit.json``: where training stands, the layout it was saved from, and a
manifest of every file the checkpoint holds (its size and SHA-256). Then the staging folder moves
into place.

What may be deleted is decided by that manifest alone, never by a folder's file names: an older
ppsplit checkpoint is replaced (``checkpoint.overwrite=true``) only when everything in its folder
is a file its manifest lists, unchanged; anything else there refuses the overwrite, naming the
first foreign entry, before any rank starts. Removing a checkpoint removes the files its manifest
lists and the folders they leave empty, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

from ppsplit.errors import PpsplitError

MARKER = "ppsplit.json"
FORMAT = 2  # 2: ppsplit.json carries the manifest of its files
_CHUNK = 1 << 20


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER)) and os.path.isfile(os.path.join(folder, ".metadata"))


def read_meta(folder: str) -> dict:
    with open(os.path.join(folder, MARKER)) as f:
        return json.load(f)


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_of(folder: str) -> dict[str, dict]:
    """Every file under ``folder`` (relative path -> bytes and SHA-256), ppsplit.json aside."""
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MARKER:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": file_digest(path)}
    return files


def foreign_entry(folder: str) -> str | None:
    """The first entry of ``folder`` that its checkpoint's manifest does not account for (a file
    it does not list, a listed file since changed, a link, a folder holding none of its files),
    or None when everything there is what ppsplit wrote."""
    try:
        files = read_meta(folder).get("files")
    except (OSError, ValueError, AttributeError):
        return MARKER
    if not isinstance(files, dict):
        return f"{MARKER} (no manifest of its files: written before ppsplit recorded one)"
    parents = {os.path.dirname(rel) for rel in files}
    parents |= {p for rel in parents for p in _ancestors(rel)}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(dirs) + sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                return rel
            if os.path.isdir(path):
                if rel not in parents:
                    return rel + "/"
            elif rel != MARKER:
                entry = files.get(rel)
                if entry is None:
                    return rel
                if os.path.getsize(path) != entry.get("bytes") or file_digest(path) != entry.get("sha256"):
                    return f"{rel} (changed since ppsplit wrote it)"
    return None


def _ancestors(rel: str):
    while rel:
        yield rel
        rel = os.path.dirname(rel)


def remove_checkpoint(folder: str) -> list[str]:
    """Remove the files ``folder``'s manifest lists, then the folders left empty. Returns what
    was left (entries that appeared meanwhile, never touched)."""
    files = read_meta(folder).get("files") or {}
    for rel in files:
        path = os.path.join(folder, rel)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    os.unlink(os.path.join(folder, MARKER))
    for root, _, _ in sorted(os.walk(folder, topdown=False), key=lambda w: -len(w[0])):
        try:
            os.rmdir(root)
        except OSError:
            pass
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


class Target:
    """Where a run's checkpoint goes: checked before any rank starts, staged, then committed."""

    def __init__(self, folder: str, overwrite: bool):
        self.folder = os.path.abspath(folder)
        self.overwrite = overwrite
        self.staging = None
        self._made_parents: list[str] = []
        self.check()

    def check(self) -> None:
        f = self.folder
        key = f"checkpoint.dir={f!r}"
        if os.path.lexists(f) and not os.path.isdir(f):
            raise PpsplitError(f"{key} is a file, not a folder; allowed: a new or empty folder")
        if os.path.isdir(f) and os.listdir(f):
            if not self.overwrite:
                raise PpsplitError(f"{key} is not empty; allowed: a new or empty folder, or "
                                   "checkpoint.overwrite=true to replace the ppsplit checkpoint in it")
            if not is_checkpoint(f):
                raise PpsplitError(f"{key} holds files that are not a ppsplit checkpoint; "
                                   "checkpoint.overwrite=true replaces only a ppsplit checkpoint; "
                                   "allowed: another folder")
            foreign = foreign_entry(f)
            if foreign is not None:
                raise PpsplitError(f"{key}: {foreign} is not part of the ppsplit checkpoint there; "
                                   "checkpoint.overwrite=true replaces a folder only when all it holds is "
                                   "what ppsplit wrote; allowed: another folder, or move it out")
        _check_writable(f, key)

    def stage(self, token: str) -> str:
        """The staging folder the ranks write into (beside the target, so the move is atomic)."""
        parent = os.path.dirname(self.folder)
        missing = []
        p = parent
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for p in reversed(missing):
            os.mkdir(p)
            self._made_parents.append(p)
        self.staging = os.path.join(parent, f".{os.path.basename(self.folder)}.partial-{token}")
        return self.staging

    def commit(self, meta: dict, config=None, architecture: str | None = None, rows=None) -> str:
        """Move the finished checkpoint into place; returns its folder. With ``config``, its
        ``hf/`` folder gets the model's ``config.json`` (``architecture``: the model class)."""
        self.check()  # nothing appeared there meanwhile that we must not replace
        if rows is not None:
            from ppsplit.output import write_rows

            write_rows(os.path.join(self.staging, "metrics.csv"), rows)
        seal(self.staging, meta, config, architecture)
        old = None
        if os.path.isdir(self.folder):
            if os.listdir(self.folder):
                old = f"{self.staging}.old"
                os.rename(self.folder, old)
            else:
                os.rmdir(self.folder)
        os.rename(self.staging, self.folder)
        self.staging = None
        if old and remove_checkpoint(old):
            print(f"ppsplit: kept {old}: it holds files that appeared during the run", flush=True)
        return self.folder

    def discard(self) -> None:
        """After a failed run: remove what this run wrote, and only that."""
        if self.staging and os.path.isdir(self.staging):
            shutil.rmtree(self.staging, ignore_errors=True)
        self.staging = None
        for p in reversed(self._made_parents):
            try:
                os.rmdir(p)  # only if still empty
            except OSError:
                break
        self._made_parents = []


def seal(staging: str, meta: dict, config=None, architecture: str | None = None) -> None:
    """Finish a staged checkpoint: its ``hf/`` folder made whole (with ``config``), then
    ``ppsplit.json`` with the manifest of every file, written last."""
    if config is not None and os.path.isdir(os.path.join(staging, "hf")):
        finish_hf(os.path.join(staging, "hf"), config, architecture)
    with open(os.path.join(staging, MARKER), "w") as f:
        json.dump({"format": FORMAT, "saved_at": time.time(), **meta, "files": manifest_of(staging)}, f, indent=2)


def _check_writable(folder: str, key: str) -> None:
    existing = os.path.dirname(folder)
    while not os.path.isdir(existing):
        if os.path.lexists(existing):
            raise PpsplitError(f"{key}: {existing!r} is a file, not a folder")
        existing = os.path.dirname(existing)
    try:  # a real write: permissions, a read-only file system, root squash...
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".ppsplit-write-check-"))
    except OSError as err:
        raise PpsplitError(f"{key} is not writable ({existing!r}: {os.strerror(err.errno) if err.errno else err}); "
                           "allowed: a folder this user can write") from None


def finish_hf(folder: str, config, architecture: str | None = None) -> None:
    """Make the safetensors the ranks wrote a ``save_pretrained`` folder: add ``config.json``
    (naming ``architecture``, the model class, as ``save_pretrained`` does), drop the per-rank
    shards the consolidation read."""
    import copy

    if architecture and not getattr(config, "architectures", None):
        config = copy.deepcopy(config)
        config.architectures = [architecture]
    config.save_pretrained(folder)
    shutil.rmtree(os.path.join(folder, "sharded"), ignore_errors=True)  # inside our own staging folder


def check_loadable(folder: str, class_name: str) -> dict:
    """Refuse ``checkpoint.load`` unless it is a ppsplit checkpoint of this model class."""
    key = f"checkpoint.load={folder!r}"
    if not os.path.isdir(folder):
        raise PpsplitError(f"{key} is not a folder; allowed: a checkpoint folder written by checkpoint.save=true")
    if not is_checkpoint(folder):
        raise PpsplitError(f"{key} is not a ppsplit checkpoint (no {MARKER} and .metadata); "
                           "allowed: a folder written by checkpoint.save=true")
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as err:
        raise PpsplitError(f"{key}: its {MARKER} cannot be read: {err}") from None
    if meta.get("model_class") != class_name:
        raise PpsplitError(f"{key} holds a {meta.get('model_class')}, not a {class_name}; "
                           "allowed: a checkpoint of the same model class")
    return meta
