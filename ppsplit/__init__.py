"""ppsplit: split a transformer into pipeline stages that keep the original FQNs, and prove it.

>>> split = ppsplit.split(model, args=(input_ids,), kwargs={...}, stages=2)
>>> report = ppsplit.verify_fqns(model, split)
>>> ppsplit.parallelize(split, 0, model, mesh)  # FSDP2 and tensor parallel on a stage, by FQN
>>> ins, outs = split.stage_io_meta(0, tp=2)  # what a tensor-parallel rank sends and receives
>>> ties = ppsplit.TiedWeights(split, {0: split.stages[0]}, mesh=mesh)  # ties.sync_grads() after backward
"""

from ppsplit.errors import CheckFailed, PpsplitError
from ppsplit.parallel.layout import parallelize
from ppsplit.parallel.ties import TiedWeights
from ppsplit.stages.trace import Split, find_blocks, split
from ppsplit.stages.verify import FqnReport, Numerics, verify_fqns, verify_numerics

__all__ = [
    "CheckFailed", "FqnReport", "Numerics", "PpsplitError", "Split",
    "TiedWeights", "find_blocks", "parallelize", "split", "verify_fqns", "verify_numerics",
]
