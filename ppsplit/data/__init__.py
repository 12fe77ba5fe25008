"""What a step eats: local corpora read as a stream, tokenized in processes and packed into a
token store that ranks memory-map; the order of its stream; chat and instruction records made
into scored rows; the batches cut from them; a toy corpus to try it with. May import:
``config``, ``models``."""
