"""What a step eats: local corpora tokenised and packed into token blocks, the batches cut from them,
and a toy corpus to try it with. May import: ``config``, ``models``."""
