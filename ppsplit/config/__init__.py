"""The job's settings: the spec every layer reads (``JobSpec`` and its parts), the named values and
tables of allowed names, the command-line checks made before Hydra composes, and the schedule's
rank arithmetic. May import: nothing else in ppsplit (only ``errors``)."""
