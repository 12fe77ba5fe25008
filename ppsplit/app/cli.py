"""The Hydra entry point: a thin layer that composes the config and calls :func:`run`.

It owns what only the command line has: the run folder Hydra makes (checked and, after bad
input, cleaned of this run's own files and nothing else), signals (SIGINT, SIGTERM and SIGHUP
stop the ranks and exit 128+signal with one line), and exit statuses (0 passed, 1 a check or a
rank failed, 2 bad input; a sweep with a failed point exits 1 after its summary).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import sys
import threading
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ppsplit.errors import CheckFailed, PpsplitError

def _conf_dir() -> str:
    """The config tree: inside an installed package (``ppsplit/conf``), else the repository's
    ``conf/`` beside the package (a checkout, or an editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ppsplit/
    packaged = os.path.join(here, "conf")
    return packaged if os.path.isfile(os.path.join(packaged, "config.yaml")) else os.path.join(
        os.path.dirname(here), "conf")


CONF_DIR = _conf_dir()
DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"  # as conf/config.yaml says


def check_config(cfg: DictConfig, overrides=None):
    """The composed config as a validated :class:`~ppsplit.config.spec.JobSpec` (no torch needed)."""
    from ppsplit.config.spec import from_config

    return from_config(cfg, overrides)


def run(cfg: DictConfig, output_dir: str, overrides=None, progress=None) -> int:
    """Do the job ``cfg`` describes and write ``report.json`` in ``output_dir``.

    Returns the exit status: 0 when every check passes, 1 when one fails. Raises
    :class:`PpsplitError` for bad input, :class:`CheckFailed` when a rank fails, and
    :class:`~ppsplit.launch.signals.Interrupted` on SIGINT, SIGTERM or SIGHUP (the ranks are stopped).
    """
    spec = check_config(cfg, overrides)
    from ppsplit.app import job  # torch and transformers load only once the config is sound
    from ppsplit.launch import signals as stop_signals

    checked = _CHECKED.pop(0) if _CHECKED else None  # what RunGuard checked before the run folder
    handlers = None
    if threading.current_thread() is threading.main_thread():
        handlers = stop_signals.install_signal_handlers()
    try:
        return job.run_job(spec, output_dir, progress, checked if checked and checked.spec == spec else None)
    finally:
        if handlers is not None:
            stop_signals.restore_signal_handlers(handlers)


class RunFolder:
    """What a run folder held before this run, so that bad input removes only this run's files:
    never a folder that existed before, nor anything another run or the user put there."""

    HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
    OWN = ("ranks", "submitit", "report.json", "error.json", "metrics.csv", "loss.png", "tensorboard")

    def __init__(self, path: str, job_name: str):
        self.path = os.path.abspath(path)
        self.log = f"{job_name}.log"
        self.missing = []
        p = self.path
        while not os.path.exists(p):
            self.missing.append(p)
            p = os.path.dirname(p)
        self.entries = set(os.listdir(self.path)) if os.path.isdir(self.path) else set()
        hydra_dir = os.path.join(self.path, ".hydra")
        self.hydra_entries = set(os.listdir(hydra_dir)) if os.path.isdir(hydra_dir) else set()

    def earlier_run(self) -> str | None:
        """What shows that an earlier run wrote in this folder (Hydra's record of its config, a
        log, a report, ranks), or None."""
        for name in (".hydra/config.yaml", ".hydra/overrides.yaml", self.log, *self.OWN):
            if os.path.lexists(os.path.join(self.path, name)):
                return name
        return None

    def claim_unique(self) -> str:
        """Create the folder, or ``<folder>-N`` for the first N free, atomically: two runs started
        in the same second get folders of their own."""
        candidate, n = self.path, 0
        os.makedirs(os.path.dirname(candidate), exist_ok=True)
        while True:
            try:
                os.mkdir(candidate)
                break
            except FileExistsError:
                n += 1
                candidate = f"{self.path}-{n}"
        if candidate != self.path:  # the default folder existed: this run made only its own
            self.path, self.missing = candidate, [candidate]
            self.entries, self.hydra_entries = set(), set()
        return candidate

    def clean(self) -> None:
        if not os.path.isdir(self.path):
            return
        hydra_dir = os.path.join(self.path, ".hydra")
        for name in self.HYDRA_FILES:
            if name not in self.hydra_entries:
                _remove(os.path.join(hydra_dir, name))
        for name in (".hydra", self.log, *self.OWN):
            if name not in self.entries:
                path = os.path.join(self.path, name)
                if name == ".hydra":
                    _rmdir(path)
                else:
                    _remove(path)
        for p in self.missing:  # deepest first; only while empty
            if not _rmdir(p):
                break


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


_RUN_FOLDER: RunFolder | None = None
_CHECKED: list = []  # the job RunGuard validated, handed to run() so that it is checked once


class RunGuard(Callback):
    """Registered in conf/config.yaml. Before Hydra makes the run folder: refuse bad input at
    once (no folder is made), give a default folder of its own to each run, and remember what a
    given folder held."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        global _RUN_FOLDER
        overrides = list(OmegaConf.select(config, "hydra.overrides.task") or [])
        try:
            spec = check_config(config, overrides)
            from ppsplit.app.checks import validate

            _CHECKED[:] = [validate(spec)]
        except PpsplitError as err:
            print(f"ppsplit: error: {err}", file=sys.stderr)
            sys.exit(2)
        raw = OmegaConf.to_container(config.hydra.run, resolve=False).get("dir")
        folder = RunFolder(OmegaConf.select(config, "hydra.run.dir"), config.hydra.job.name)
        earlier = folder.earlier_run()
        if raw != DEFAULT_RUN_DIR and earlier:
            print(f"ppsplit: error: hydra.run.dir={folder.path} holds an earlier run ({earlier}); a run never "
                  "changes another run's files; allowed: a new or empty folder, or leave hydra.run.dir to its "
                  "default (a new folder for each run)", file=sys.stderr)
            sys.exit(2)
        if raw == DEFAULT_RUN_DIR:
            claimed = folder.claim_unique()
            with read_write(config.hydra.run), open_dict(config.hydra.run):
                config.hydra.run.dir = claimed
        _RUN_FOLDER = folder

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
        if os.path.isfile(os.path.join(sweep_dir, "multirun.yaml")):
            print(f"ppsplit: error: hydra.sweep.dir={os.path.abspath(sweep_dir)} holds an earlier sweep "
                  "(multirun.yaml); a run never changes another run's files; allowed: a new or empty folder",
                  file=sys.stderr)
            sys.exit(2)
        if OmegaConf.select(config, "launcher.name") == "slurm":
            from ppsplit.launch.slurm import check_slurm_controller

            try:
                partition, nodes = (OmegaConf.select(config, f"launcher.{k}") for k in ("partition", "nodes"))
                # Each point checks its own values again when it starts; here only the plain ones.
                check_slurm_controller(partition if isinstance(partition, str) else None,
                                       nodes if isinstance(nodes, int) else 1)
            except PpsplitError as err:
                print(f"ppsplit: error: {err}", file=sys.stderr)
                sys.exit(2)


def _message(err: BaseException) -> tuple[str, int]:
    from ppsplit.errors import Interrupted

    if isinstance(err, PpsplitError):
        return f"ppsplit: error: {err}", 2
    if isinstance(err, CheckFailed):
        return f"ppsplit: check failed: {err}", 1
    if isinstance(err, Interrupted):
        return f"ppsplit: interrupted by {err.name}; no rank is left running", 128 + err.signum
    if isinstance(err, KeyboardInterrupt):
        return "ppsplit: interrupted by SIGINT; no rank is left running", 128 + signal.SIGINT
    if os.environ.get("PPSPLIT_DEBUG"):
        traceback.print_exception(err)
    from ppsplit.launch.control import one_line

    return f"ppsplit: failed: {one_line(err)} (PPSPLIT_DEBUG=1 shows the traceback)", 1


class _Tee:
    """A console stream that also writes to the run folder's log (not a bar's redraws)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        if "\r" not in text:
            self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> int:
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    single = hydra_cfg.mode == RunMode.RUN
    overrides = list(hydra_cfg.overrides.task)
    message = saved = None
    log = open(os.path.join(output_dir, f"{hydra_cfg.job.name}.log"), "a")
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    try:
        try:
            from ppsplit.output import Progress

            code = run(cfg, output_dir, overrides, Progress(enabled=True))
        except BaseException as err:  # every failure ends in one line and an exit status
            if isinstance(err, SystemExit):
                raise
            message, code = _message(err)
            saved = getattr(err, "saved", None)
        if message and code > 128:
            from ppsplit.launch.signals import say_interrupted

            say_interrupted(code - 128, saved)
        elif message:
            print(message, file=sys.stderr, flush=True)
    finally:
        sys.stdout, sys.stderr = streams
        log.close()
    if code > 128:  # a stop signal: the run has cleaned up; end now, not after a slow teardown
        _end_now(code)
    if single:
        if code == 2 and _RUN_FOLDER is not None:
            _RUN_FOLDER.clean()
        if code:
            sys.exit(code)
    elif message:  # a sweep goes on; its summary says why this point failed
        from ppsplit.output import write_json

        write_json(os.path.join(output_dir, "error.json"), {"ok": False, "exit_status": code, "error": message})
    return code


def _end_now(code: int) -> None:
    from ppsplit.launch.local import shutdown_launcher

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    shutdown_launcher(wait=False)
    os._exit(code)


# The driver's start makes objects by the million (Hydra's composition, torch.export's trace, the
# check's two models) and keeps most of them only briefly. At the interpreter's default
# thresholds (700, 10, 10) they outlived the young generations and set off full collections:
# 1.2-1.4 s of collecting in a 7-10 s default run here. These keep them young and short-lived:
# about 0.3 s, the same peak memory. (Ranks freeze what they inherit and collect little.)
DRIVER_GC_THRESHOLDS = (10_000, 50, 100)


def main() -> None:
    """``ppsplit`` / ``python -m ppsplit``."""
    gc.set_threshold(*DRIVER_GC_THRESHOLDS)
    from ppsplit.launch.local import allow_fork, shutdown_launcher
    from ppsplit.config.overrides import check_command_line

    allow_fork()  # nothing has run yet: local ranks can come from a fork of this process

    try:
        check_command_line(sys.argv[1:], CONF_DIR, compose=False)
    except PpsplitError as err:  # Hydra would print several lines and exit 1
        print(f"ppsplit: error: {err}", file=sys.stderr)
        sys.exit(2)
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # what Hydra refuses comes back here as an exception, to be said in one line
    try:
        hydra_main()
    except HydraException as err:  # composing the config: a key or an option that does not exist
        from ppsplit.config.overrides import refusal

        print(f"ppsplit: error: {refusal(err, sys.argv[1:], CONF_DIR)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ppsplit: interrupted by SIGINT", file=sys.stderr)
        sys.exit(130)
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error
        shutdown_launcher()
    from ppsplit.report.sweep import failed_points

    if failed_points():
        sys.exit(1)


def forked(args: list[str]) -> None:
    """``ppsplit ARGS`` in a process forked by :mod:`ppsplit.launch.local` (tests start the
    command line this way, without paying for the imports each time)."""
    sys.argv = ["ppsplit", *args]
    main()


if __name__ == "__main__":
    main()
