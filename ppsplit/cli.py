"""The Hydra entry point: a thin layer that composes the config and calls :func:`run`."""

from __future__ import annotations

import os
import shutil
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ppsplit.errors import CheckFailed, PpsplitError

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PpsplitError(f"{key}={value!r}: must be an integer >= {minimum}")
    return value


def check_config(cfg: DictConfig) -> None:
    """Refuse bad top-level values before any work starts."""
    for key in ("stages", "microbatches", "batch_size", "seq_len"):
        _positive_int(cfg, key)
    _positive_int(cfg, "steps", minimum=0)
    if cfg.batch_size % cfg.microbatches:
        raise PpsplitError(
            f"batch_size={cfg.batch_size} is not divisible by microbatches={cfg.microbatches}; "
            "allowed: a batch_size that is a multiple of microbatches"
        )
    if cfg.split.name == "manual":
        if OmegaConf.is_missing(cfg.split, "points"):
            raise PpsplitError("split=manual needs split.points, e.g. 'split.points=[transformer.h.2]'")
        points = cfg.split.points
        if not OmegaConf.is_list(points) or not all(isinstance(p, str) for p in points):
            raise PpsplitError(
                f"split.points={OmegaConf.to_container(points) if OmegaConf.is_config(points) else points!r}: "
                "must be a list of module FQNs, e.g. [transformer.h.2]"
            )


def run(cfg: DictConfig, output_dir: str) -> int:
    """Do the job ``cfg`` describes and write ``report.json`` in ``output_dir``.

    Returns the exit status: 0 when every check passes, 1 when one fails. Raises
    :class:`PpsplitError` for bad input.
    """
    check_config(cfg)
    from ppsplit import job  # torch and transformers load only once the config is sound

    return job.run_job(cfg, output_dir)


def _clean_run_dir(output_dir: str) -> None:
    """After bad input, leave no run folder behind: it holds only Hydra's own files."""
    if os.path.isdir(output_dir) and not os.path.exists(os.path.join(output_dir, "report.json")):
        shutil.rmtree(output_dir, ignore_errors=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> int:
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    single = hydra_cfg.mode == RunMode.RUN
    message = None
    try:
        code = run(cfg, output_dir)
    except PpsplitError as err:
        message, code = f"ppsplit: error: {err}", 2
    except CheckFailed as err:
        message, code = f"ppsplit: check failed: {err}", 1
    except Exception as err:  # a failure inside torch or transformers: one line, not a traceback
        if os.environ.get("PPSPLIT_DEBUG"):
            traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0]
        message = f"ppsplit: failed: {type(err).__name__}: {first} (PPSPLIT_DEBUG=1 shows the traceback)"
        code = 1
    if message:
        print(message, file=sys.stderr)
    if single:
        if code == 2:
            _clean_run_dir(output_dir)
        if code:
            sys.exit(code)
    elif message:  # a sweep goes on; its summary says why this point failed
        from ppsplit.report import write_json

        write_json(os.path.join(output_dir, "error.json"), {"ok": False, "exit_status": code, "error": message})
    return code


if __name__ == "__main__":
    main()
