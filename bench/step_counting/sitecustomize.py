"""Loaded at interpreter start when this folder is on PYTHONPATH (bench/step_overheads.py puts it
there for the jobs it runs): with PPSPLIT_COUNT_DIR set, every process of the job counts its
collectives and host syncs, and each rank writes what each training step made."""

import os

if os.environ.get("PPSPLIT_COUNT_DIR"):
    from step_counter import install

    install(os.environ["PPSPLIT_COUNT_DIR"])
