"""Periodic checkpoints (``checkpoint.every=N``): a step folder each N steps, the newest K kept,
a ``latest`` link, one run at a time.

Under ``checkpoint.dir`` a run writes ``step-000300/`` and so on, each a whole checkpoint as
:mod:`ppsplit.checkpoint.folder` writes one (staged beside, sealed with its manifest, then moved
into place), holding also ``metrics.csv`` up to its step. After each one stands:

- ``latest`` (a symbolic link to the newest step folder) is replaced in one ``rename``;
- with ``checkpoint.keep=K``, the step folders older than the K newest are removed, each only
  when its manifest accounts for all it holds; anything else there is never touched. The folder
  a resumed run loaded from stays until the run's final step stands: the unsplit reference
  reads it again at the end.

``checkpoint.load=auto`` resumes from the newest complete step folder, or starts fresh when
there is none. A lock (``.ppsplit.lock``, held with ``flock`` for the run) refuses a second run
in the same folder; it records the holder's staging token, so the next run removes what a
killed one left staged, and only that.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import threading

from ppsplit.checkpoint.folder import _check_writable, foreign_entry, is_checkpoint, read_meta, remove_checkpoint, seal
from ppsplit.errors import PpsplitError
from ppsplit.output import write_rows

LOCK = ".ppsplit.lock"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d{6,})$")
DATA_KEYS = ("name", "path", "seed", "batch_size", "seq_len", "seq_lens")  # what places the data stream


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def staging_path(folder: str, step: int, token: str) -> str:
    """Where the ranks write the checkpoint of ``step`` before it is sealed."""
    return os.path.join(folder, f".{step_name(step)}.partial-{token}")


def step_folders(folder: str) -> list[tuple[int, str]]:
    """The complete ppsplit checkpoints under ``folder``, oldest first: (step, path)."""
    out = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            match = _STEP.match(name)
            path = os.path.join(folder, name)
            if match and not os.path.islink(path) and is_checkpoint(path):
                out.append((int(match.group(1)), path))
    return sorted(out)


def newest(folder: str) -> str | None:
    found = step_folders(folder)
    return found[-1][1] if found else None


def _ours(name: str) -> bool:
    """Entries a series folder holds besides its step folders."""
    return name in (LOCK, LATEST) or name.startswith(".step-") or name.startswith(".latest-")


def check_folder(folder: str, auto: bool) -> None:
    """Refuse a ``checkpoint.dir`` this run must not write step folders into (before any rank
    starts): a file, a folder of other things, an earlier run's steps unless resuming from them."""
    key = f"checkpoint.dir={folder!r}"
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise PpsplitError(f"{key} is a file, not a folder; allowed: a new or empty folder")
    if os.path.isdir(folder):
        latest = os.path.join(folder, LATEST)
        if os.path.lexists(latest) and not os.path.islink(latest):
            raise PpsplitError(f"{key}: {LATEST} there is not the link ppsplit keeps; allowed: another folder, "
                               "or move it out")
        steps = step_folders(folder)
        if steps and not auto:
            raise PpsplitError(f"{key} holds the checkpoints of an earlier run (newest: {step_name(steps[-1][0])}); "
                               "allowed: checkpoint.load=auto to go on from the newest, or a new or empty folder")
        if not steps and any(not _ours(n) for n in os.listdir(folder)):
            first = sorted(n for n in os.listdir(folder) if not _ours(n))[0]
            raise PpsplitError(f"{key} is not empty ({first} is not a ppsplit checkpoint); allowed: a new or "
                               "empty folder, or one that checkpoint.every filled")
    _check_writable(os.path.join(folder, "x"), key)


def data_identity(spec) -> dict:
    """What places a run's data stream, as ``ppsplit.json`` records it."""
    return {"name": spec.data.name, "path": list(spec.data.path), "seed": spec.seed,
            "batch_size": spec.batch_size, "seq_len": spec.seq_len, "seq_lens": list(spec.seq_lens)}


def check_auto_resume(folder: str, data: dict) -> str | None:
    """The newest checkpoint to resume from (None: start fresh), refused when it was made with
    another data config (``data``: this run's, as :func:`ppsplit.checkpoint.meta.checkpoint_meta` records it)."""
    path = newest(folder)
    if path is None:
        return None
    saved = read_meta(path).get("data") or {}
    for k in DATA_KEYS:
        if k in saved and _plain(saved[k]) != _plain(data.get(k)):
            prefix = "" if k in ("seed", "batch_size", "seq_len", "seq_lens") else "data."
            raise PpsplitError(f"checkpoint.load=auto: {path} was made with {prefix}{k}={saved[k]!r} (here "
                               f"{data.get(k)!r}), so its data stream does not go on here; allowed: the same "
                               "data config, or another checkpoint.dir")
    return path


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


class Lock:
    """``checkpoint.dir`` held by one run: an exclusive ``flock`` that the kernel drops when the
    process ends, however it ends."""

    def __init__(self, folder: str, token: str):
        self.path = os.path.join(folder, LOCK)
        self.token = token
        self._fd = None

    @staticmethod
    def holder(folder: str) -> str | None:
        """The pid of the run holding ``folder``, or None when it is free."""
        path = os.path.join(folder, LOCK)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return (f.read().split() or ["?"])[0]
            fcntl.flock(f, fcntl.LOCK_UN)
        return None

    def acquire(self) -> str | None:
        """Take the lock; returns the staging token of the run that held it last (a killed one)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = (os.pread(fd, 200, 0).decode(errors="replace").split() or ["?"])[0]
            os.close(fd)
            raise PpsplitError(f"checkpoint.dir={os.path.dirname(self.path)!r} is in use by another run (pid {pid}); "
                               "allowed: another folder, or wait until that run ends") from None
        before = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.token}\n".encode(), 0)
        self._fd = fd
        return before[1] if len(before) > 1 else None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor; the file stays, it is ours
            self._fd = None


class Series:
    """The step folders of one run under ``folder``, the final one included. It quacks like
    :class:`~ppsplit.checkpoint.folder.Target` for the final checkpoint (``stage``, ``commit``,
    ``discard``); :meth:`commit_step` seals a periodic one."""

    def __init__(self, folder: str, every: int, keep: int | None, final_step: int, auto: bool = False,
                 loaded: str | None = None):
        self.folder, self.every, self.keep, self.final_step = os.path.abspath(folder), every, keep, final_step
        self.loaded = os.path.realpath(loaded) if loaded else None  # read until the run's end
        check_folder(self.folder, auto)
        self.token = os.urandom(4).hex()
        self.staging: str | None = None
        self.committed: list[str] = []
        self._lock = Lock(self.folder, self.token)
        stale = self._lock.acquire()
        if stale:
            self._remove_staged(stale)

    # Target's interface, for the final checkpoint
    def stage(self, token: str | None = None) -> str:
        self.staging = staging_path(self.folder, self.final_step, self.token)
        return self.staging

    def commit(self, meta: dict, config=None, architecture: str | None = None, rows=None) -> str:
        path = self.commit_step(self.final_step, meta, rows, config, architecture)
        self.staging = None
        return path

    def discard(self) -> None:
        self._remove_staged(self.token)
        self.staging = None

    def close(self) -> None:
        self._lock.release()

    # the periodic ones
    def commit_step(self, step: int, meta: dict, rows=None, config=None, architecture: str | None = None) -> str:
        """Seal the staged checkpoint of ``step`` and move it into place; then point ``latest``
        at it and drop what ``keep`` no longer keeps."""
        staged = staging_path(self.folder, step, self.token)
        if rows is not None:
            write_rows(os.path.join(staged, "metrics.csv"), rows)
        seal(staged, meta, config, architecture)
        final = os.path.join(self.folder, step_name(step))
        if os.path.lexists(final):  # only an earlier run's, refused unless it is a whole ppsplit checkpoint
            if not is_checkpoint(final) or foreign_entry(final) is not None:
                raise PpsplitError(f"checkpoint.dir: {final} exists and is not a ppsplit checkpoint; it was left "
                                   "as it is and this step was not saved")
            old = f"{staged}.old"
            os.rename(final, old)
            os.rename(staged, final)
            remove_checkpoint(old)
        else:
            os.rename(staged, final)
        link = os.path.join(self.folder, f".latest-{self.token}")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(step_name(step), link)
        os.replace(link, os.path.join(self.folder, LATEST))  # one rename: never a moment without it
        self.committed.append(final)
        self._prune(spare=None if step == self.final_step else self.loaded)
        return final

    def _prune(self, spare: str | None) -> None:
        if not self.keep:
            return
        steps = step_folders(self.folder)
        for _, path in steps[:-self.keep]:
            if os.path.realpath(path) == spare:
                continue
            if foreign_entry(path) is None:  # nothing in it that ppsplit did not write
                remove_checkpoint(path)

    def _remove_staged(self, token: str) -> None:
        pattern = re.compile(rf"^\.step-\d{{6,}}\.partial-{re.escape(token)}(\.old)?$")
        for name in os.listdir(self.folder):
            if pattern.match(name):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)  # our own staging


class PeriodicSaves:
    """The driver's side of the ranks' periodic saves: a step the ranks saved is sealed once the
    metrics log holds its row (both arrive through the heartbeats, in either order)."""

    def __init__(self, series: Series, meta_of, log):
        self.series, self.meta_of, self.log = series, meta_of, log
        self.pending: set[int] = set()
        self.done: set[int] = set()
        self.say = None
        self._lock = threading.Lock()

    def saved(self, step: int) -> None:
        with self._lock:
            if step not in self.done:
                self.pending.add(step)
            self._flush(False)

    def flush(self, force: bool = False) -> None:
        with self._lock:  # the monitor thread and, at the end, the main one
            self._flush(force)

    def _flush(self, force: bool) -> None:
        have = self.log.last_step() if self.log is not None else None
        for step in sorted(self.pending):
            if not force and have is not None and have < step:
                continue
            self.pending.discard(step)
            self.done.add(step)
            path = self.series.commit_step(step, self.meta_of(step), self.log.rows_through(step) if self.log else None)
            if self.say is not None:
                self.say(f"checkpoint: {path}")
