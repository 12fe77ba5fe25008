"""The command line for tests without paying for Python's imports each time.

Most of a ``python -m ppsplit`` run on this machine is importing torch, transformers and Hydra
(about 7 s of CPU). Here ppsplit's own launcher (:mod:`ppsplit.launch.local`, the one that forks
local ranks) imports them once, in a process that runs nothing else, and forks each command
line from it: ``ppsplit.app.cli.main`` with the test's arguments, environment and folder, in a
session of its own, its output and errors to files. It is the program ``python -m ppsplit``
runs, minus the interpreter's start; tests of the installed command itself (``test_install``,
the README's commands) start real processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from ppsplit.launch.local import Launcher

PRELOAD = ("ppsplit.app.cli", "ppsplit.app.job", "ppsplit.launch.dispatch", "hydra", "omegaconf", "datasets",
           "transformers.GPT2LMHeadModel", "transformers.LlamaForCausalLM", "transformers.BertForMaskedLM",
           "transformers.T5ForConditionalGeneration", "transformers.Qwen2MoeForCausalLM",
           "transformers.BartForConditionalGeneration", "transformers.ViTForImageClassification",
           "transformers.AlbertForMaskedLM", "transformers.Qwen2ForCausalLM", "transformers.AutoTokenizer",
           # what nearly every run imports on its way (about 0.3 s a run): the export machinery,
           # the check, the reports and their pictures
           "torch.export._trace", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
           "ppsplit.stages.trace", "ppsplit.stages.verify", "ppsplit.train.compare", "ppsplit.report.timeline",
           "ppsplit.report.sweep", "ppsplit.checkpoint.dcp", "matplotlib.pyplot")
_SERVER: Launcher | None = None
_LOCK = threading.Lock()


def server() -> Launcher:
    global _SERVER
    with _LOCK:
        if _SERVER is None or not _SERVER.alive():
            _SERVER = Launcher()
            _SERVER.preload(*PRELOAD)
        return _SERVER


class ForkedCli:
    """One ``ppsplit`` command line, forked; the parts of ``subprocess.Popen`` tests use."""

    def __init__(self, args, cwd, env=None):
        self.args = list(map(str, args))
        self._files = tempfile.mkdtemp(prefix="ppsplit-cli-")
        self.out_path, self.err_path = os.path.join(self._files, "out"), os.path.join(self._files, "err")
        self.server = server()
        full_env = {**os.environ, **(env or {})}
        ident = self.server.submit("ppsplit.app.cli", self.args, full_env, self.out_path, self.err_path, cwd=str(cwd))
        self.pid = self.server.pid(ident, wait_s=600)
        self.returncode = None
        self._err_offset = 0
        self._text: dict[str, str] = {}

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.stdout(), self.stderr()

    def stdout(self) -> str:
        return self._read("out")

    def stderr(self) -> str:
        return self._read("err")

    def _read(self, name: str) -> str:
        """The whole file once the process has ended (then the files go), else what is there."""
        if name in self._text:
            return self._text[name]
        with open(os.path.join(self._files, name)) as f:
            text = f.read()
        if self.poll() is not None:
            self._text[name] = text
            if len(self._text) == 2:
                shutil.rmtree(self._files, ignore_errors=True)
        return text

    def stderr_lines(self, timeout: float):
        """Lines of its errors as they come, until it exits or ``timeout`` passes."""
        end, buffer = time.monotonic() + timeout, ""
        while time.monotonic() < end:
            if "err" in self._text:
                return
            try:
                with open(self.err_path) as f:
                    f.seek(self._err_offset)
                    chunk = f.read()
            except FileNotFoundError:  # the forked process has not opened it yet
                chunk = ""
            self._err_offset += len(chunk)
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            yield from lines
            if self.poll() is not None and not chunk:
                return
            time.sleep(0.02)

    def send_signal(self, sig) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_cli(*args, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    """``ppsplit ARGS`` in ``cwd``, to its end; as ``subprocess.run(..., capture_output=True)``."""
    proc = ForkedCli(args, cwd, env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(["ppsplit", *proc.args], proc.returncode, out, err)
