"""Models from their configs or local folders: the class for a name, random or per-FQN
initialisation, reads of safetensors checkpoints, and the tasks a model can have. May import:
``config``."""
