"""Steps: the objective of a step, optimisers and schedules of the learning rate, the loop a rank (or
one process) runs, dropout masks that match the unsplit model's, the metrics a step writes, and
the comparison with the unsplit model. May import: ``config``, ``models``, ``data``, ``stages``,
``parallel``."""
