"""ppsplit: split a transformer into pipeline stages that keep the original FQNs, and prove it.

>>> split = ppsplit.split(model, args=(input_ids,), kwargs={...}, stages=2)
>>> report = ppsplit.verify_fqns(model, split)
>>> ppsplit.parallelize(split, 0, model, mesh)  # FSDP2 and tensor parallel on a stage, by FQN
"""

from ppsplit.errors import CheckFailed, PpsplitError
from ppsplit.layout import parallelize
from ppsplit.trace_split import Split, find_blocks, split
from ppsplit.verify import FqnReport, Numerics, verify_fqns, verify_numerics

__all__ = [
    "CheckFailed", "FqnReport", "Numerics", "PpsplitError", "Split",
    "find_blocks", "parallelize", "split", "verify_fqns", "verify_numerics",
]
