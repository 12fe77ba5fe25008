"""What a run saves and reads back: DCP checkpoints keyed by FQN, the run folder and its series of
checkpoints, and a reader that runs no code from a file. May import: ``config``, ``models``,
``stages``, ``parallel``, ``train``."""
