"""Local ranks: one process per rank on this machine, forked from a warm launcher.

A rank started as ``python -m ...`` pays for importing torch and transformers (about 6 s of CPU
here) before it does anything, once per rank. Instead, a launcher process is started once, at
the beginning of a run (its imports overlap the driver's build and trace), and forks every rank
from that state. The launcher never runs a torch operation: a process forked after OpenMP has run
hangs in its next parallel region, which is also why the driver itself is never forked.

The launcher serves every run of the process that started it (the points of a sweep, repeated
calls of the Python API) and ends with it: when its pipe closes, or its parent is gone (then
every rank it started is killed). Each rank runs in its own session (a Ctrl-C in the terminal
reaches only the driver, which stops the ranks) and is killed by the kernel if the launcher dies.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

KILL_AFTER_S = 2.0  # SIGKILL this long after SIGTERM
START_TIMEOUT_S = 600.0  # the launcher's imports on a loaded machine, and the fork
PRELOAD = ("torch", "transformers", "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "ppsplit.launch.rank",
           # every rank traces its model: export's own imports (0.14 s of a rank's first export here)
           "torch.export._trace", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
           "ppsplit.train.rank")
_HEADER = struct.Struct("!I")


def _send(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int):
    """The next message on ``fd``, or None at end of file."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    data = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


# --- the driver's side ---------------------------------------------------------------------------

class LauncherGone(RuntimeError):
    pass


class Launcher:
    """The driver's handle on its launcher process. Requests are answered in order; a fork is
    asked for at once and its pid read when needed, so a driver goes on while the launcher
    finishes its imports."""

    def __init__(self, fork: bool = False):
        """``fork``: fork it from this process, which must not have run a torch operation yet
        (it then needs no imports of its own); else start it as a new interpreter."""
        if fork:
            self.proc = _ForkedServer()
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ppsplit.launch.local", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.ready = False  # its imports are done: it answers within milliseconds
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._pids: dict[int, int | str] = {}  # request id -> pid (or why the fork failed)
        self._exits: dict[int, int] = {}  # pid -> exit status (negative: killed by that signal)
        self._ended = False
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="ppsplit-launcher", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            try:
                message = _recv(fd)
            except (OSError, EOFError, pickle.UnpicklingError):
                message = None
            with self._changed:
                if message is None:
                    self._ended = True
                elif "ready" in message:
                    self.ready = True
                elif "started" in message:
                    self._pids[message["started"]] = message.get("pid", message.get("error"))
                elif "exit" in message:
                    self._exits[message["exit"]] = message["status"]
                self._changed.notify_all()
            if message is None:
                return

    def alive(self) -> bool:
        return not self._ended and self.proc.poll() is None

    def preload(self, *modules: str) -> None:
        """Import these modules in the launcher (a model class: ``transformers.X``)."""
        self._write({"import": list(modules)})

    def _write(self, message: dict) -> None:
        with self._lock:
            try:
                _send(self.proc.stdin, message)
            except (OSError, ValueError):
                raise LauncherGone("the local rank launcher has ended") from None

    def submit(self, module: str, args: list[str], env: dict, log: str, errors: str | None = None,
               cwd: str | None = None) -> int:
        """Ask for a process that runs ``module.forked(args)`` with ``env`` in ``cwd`` (default:
        this one's), its output to ``log`` (its errors too, unless ``errors`` names another
        file); returns the request's id (see :meth:`pid`)."""
        with self._lock:
            self._next += 1
            ident = self._next
        self._write({"start": ident, "module": module, "args": args, "env": env, "cwd": cwd or os.getcwd(),
                     "log": log, "errors": errors or log})
        return ident

    def pid(self, ident: int, wait_s: float = 0.0) -> int | None:
        """The pid of request ``ident``, waiting up to ``wait_s`` for it (None: not yet)."""
        end = time.monotonic() + wait_s
        with self._changed:
            while ident not in self._pids:
                left = end - time.monotonic()
                if self._ended:
                    raise LauncherGone("the local rank launcher ended before it started the rank")
                if left <= 0:
                    return None
                self._changed.wait(min(left, 0.5))
            pid = self._pids[ident]
        if isinstance(pid, str):
            raise LauncherGone(f"the local rank launcher could not start a rank: {pid}")
        return pid

    def exit_status(self, pid: int) -> int | None:
        with self._changed:
            status = self._exits.get(pid)
        if status is None and not self.alive():
            return -signal.SIGKILL  # its launcher is gone, and the kernel killed it with it
        return status

    def close(self, wait: bool = True) -> None:
        """End the launcher (and so whatever it started that still runs)."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        if not self.ready:  # still importing: it has forked nothing, and would not read its pipe yet
            with contextlib.suppress(OSError):
                self.proc.kill()
        if not wait:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _ForkedServer:
    """A launcher forked from this process (the part of ``subprocess.Popen`` that is used)."""

    def __init__(self):
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(from_parent)
                os.close(from_child)
                _serve_forked(parent, to_child, to_parent)
            finally:
                os._exit(0)
        os.close(to_child)
        os.close(to_parent)
        self.pid = pid
        self.stdin = os.fdopen(from_parent, "wb", buffering=0)
        self.stdout = os.fdopen(from_child, "rb", buffering=0)
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("ppsplit launcher", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _serve_forked(parent: int, commands: int, replies: int) -> None:
    """In a launcher forked from its driver: drop what belongs to the driver, then serve."""
    import logging

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    logging.root.handlers.clear()  # the driver's log files are not ours to write
    sys.stdout = sys.stderr = open(os.devnull, "w")
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    serve(parent, commands, os.fdopen(replies, "wb", buffering=0))


_LAUNCHER: Launcher | None = None
_LAUNCHER_LOCK = threading.Lock()
_FORK_OK = False  # this process has run no torch operation yet: a launcher may be forked from it


def allow_fork() -> None:
    """Called first thing by the command line: the next launcher is forked from this process,
    which has imported torch by then but run nothing (so the fork is safe), instead of being
    started as a new interpreter that imports torch and transformers again."""
    global _FORK_OK
    _FORK_OK = True


def launcher() -> Launcher:
    """This process's launcher, started on first use (or again, if it ended)."""
    global _LAUNCHER, _FORK_OK
    with _LAUNCHER_LOCK:
        if _LAUNCHER is None or not _LAUNCHER.alive():
            fork, _FORK_OK = _FORK_OK, False  # once: the driver computes after this
            _LAUNCHER = Launcher(fork=fork)
        return _LAUNCHER


def shutdown_launcher(which: Launcher | None = None, wait: bool = True) -> None:
    """End this process's launcher (``which``: only if it is that one); ``wait=False`` only tells
    it to end. It also ends by itself when this process does."""
    global _LAUNCHER
    with _LAUNCHER_LOCK:
        if _LAUNCHER is not None and which in (None, _LAUNCHER):
            _LAUNCHER.close(wait)
            _LAUNCHER = None


class LocalProcesses:
    """One process per rank on this machine, forked by the launcher, each in its own session."""

    def __init__(self, launch_file: str, world: int, folder: str, threads: int):
        self.folder = folder
        self.launcher = launcher()
        env = dict(os.environ)
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)  # the ranks rendezvous on the driver's store, never on these
        env.update(OMP_NUM_THREADS=str(threads), PPSPLIT_DRIVER_PID=str(os.getpid()))
        self._requests = [self.launcher.submit("ppsplit.launch.rank", [launch_file, str(rank), str(world)],
                                               env, self.log(rank)) for rank in range(world)]

    def log(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.log")

    def _pid(self, rank: int, wait_s: float = 0.0) -> int | None:
        try:
            return self.launcher.pid(self._requests[rank], wait_s)
        except LauncherGone:
            return None

    def exit_status(self, rank: int) -> int | None:
        pid = self._pid(rank)
        if pid is None:  # not forked yet, or never: its launcher ended first
            return None if self.launcher.alive() else -signal.SIGKILL
        return self.launcher.exit_status(pid)

    def pids(self, wait_s: float = START_TIMEOUT_S) -> list[int]:
        """Every rank's pid, once the launcher has forked them."""
        return [self.launcher.pid(ident, wait_s) for ident in self._requests]

    def describe(self) -> str:
        return f"local processes {', '.join(map(str, self.pids()))}; logs in {self.folder}"

    def _running(self) -> list[int]:
        return [pid for pid in (self._pid(r) for r in range(len(self._requests)))
                if pid is not None and self.launcher.exit_status(pid) is None]

    def cancel(self) -> None:
        """SIGTERM to every rank's process group, SIGKILL to what is left after KILL_AFTER_S.
        A launcher still busy with its imports has forked nothing yet: it is ended instead."""
        if not self.launcher.ready and any(self._pid(r) is None for r in range(len(self._requests))):
            shutdown_launcher(self.launcher, wait=False)
        with contextlib.suppress(LauncherGone):
            self.pids(wait_s=KILL_AFTER_S)  # forks asked for and under way
        for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, 5.0)):
            for pid in self._running():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and self._running():
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every rank at once, and end the launcher (which kills what it forked since)."""
        for pid in self._running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            self.launcher.proc.stdin.close()

    def finished(self) -> None:
        end = time.monotonic() + 10
        while time.monotonic() < end and self._running():
            time.sleep(0.05)
        self.cancel()  # nothing is left, whatever a rank did


# --- the launcher process ------------------------------------------------------------------------

def _become(message: dict, launcher_pid: int) -> None:
    """In the forked child: become the process ``message`` describes. Never returns."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        if os.getppid() != launcher_pid:
            os._exit(75)
        log = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        errors = log if message["errors"] == message["log"] else \
            os.open(message["errors"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(errors, 2)
        os.closerange(3, 65536)  # the launcher's pipes among them: its driver sees their end
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        import logging

        logging.root.handlers.clear()
        import io

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        import gc

        # What the parent held and let go (its streams, their log files, garbage in a cycle)
        # still names descriptors closed above. A later collection would close whatever this
        # process had opened under such a number since (a rank's TCPStore connection: "Bad file
        # descriptor"), so no collection ever looks at what came from the parent; it costs
        # nothing (a collection here took 0.18 s per child).
        gc.freeze()
        import importlib

        module = importlib.import_module(message["module"])
        sys.argv = [module.__file__, *message["args"]]
        module.forked(message["args"])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(parent_pid: int, commands: int, out) -> None:
    """The launcher: import, then fork a process for each request read from ``commands`` until
    that pipe closes or ``parent_pid`` is gone; replies go to ``out``. (Not tied to its parent by
    the kernel: that ties it to the thread that started it, and a run may come from any thread.)"""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the driver stops its ranks, then ends this process
    import importlib

    children: set[int] = set()
    try:
        for name in PRELOAD:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        _send(out, {"ready": True})
        me = os.getpid()
        while True:
            ready, _, _ = select.select([commands], [], [], 0.05)
            _reap(children, out)
            if os.getppid() != parent_pid:
                return
            if not ready:
                continue
            message = _recv(commands)
            if message is None:
                return
            if "import" in message:
                _preload(message["import"])
            elif "start" in message:
                try:
                    pid = os.fork()
                except OSError as err:
                    _send(out, {"started": message["start"], "error": str(err)})
                    continue
                if pid == 0:
                    _become(message, me)
                children.add(pid)
                _send(out, {"started": message["start"], "pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def _preload(names) -> None:
    import importlib

    for name in names:
        with contextlib.suppress(Exception):
            if name.startswith("transformers."):
                getattr(importlib.import_module("transformers"), name.split(".", 1)[1])
            else:
                importlib.import_module(name)


def _reap(children: set[int], out) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            _send(out, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _serve_new() -> None:
    """A launcher started as its own interpreter: commands on stdin, replies on a copy of stdout."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # whatever an import prints must not reach the protocol
    serve(int(sys.argv[1]), 0, out)


if __name__ == "__main__":
    try:
        _serve_new()
    finally:
        os._exit(0)  # at once: tearing down torch and transformers takes a second or more
