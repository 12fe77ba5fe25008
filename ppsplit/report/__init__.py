"""What a run prints and writes: the stage table, the verdict, ``report.json`` and its schema, the
timeline and its bubbles, plots and the sweep's summary. May import: everything below ``app``."""
