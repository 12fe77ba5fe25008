"""A stage on a mesh: FSDP2 and tensor-parallel layouts keyed by FQN, the shapes that flow between
sharded stages, tied weights kept in step, and stages built on meta and filled. May import:
``config``, ``models``, ``stages``."""
