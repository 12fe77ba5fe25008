"""The pipeline schedules of ``torch.distributed.pipelining`` and how stages map to ranks under
each: which combinations of stages, stages per rank and microbatches a schedule can run (the
rules torch checks only once the ranks have started), and which stages a rank runs."""

from __future__ import annotations

from dataclasses import dataclass

from ppsplit.config.values import choice
from ppsplit.errors import PpsplitError

# Each schedule: its torch.distributed.pipelining class, and how stages map to ranks
# ("single": one stage per rank; "loop": rank r runs r, r+R, ...; "v": rank r runs r and 2R-1-r).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # backward split into input and weight parts


@dataclass(frozen=True)
class RankPlan:
    ranks: int  # pipeline ranks (one data- and tensor-parallel coordinate)
    stages_per_rank: int
    placement: str  # "single", "loop" or "v"


def plan_ranks(schedule: str, stages: int, stages_per_rank: int | None, microbatches: int) -> RankPlan:
    """Map stages to pipeline ranks for ``schedule``, refusing combinations it cannot run (the
    rules torch's schedules check only once the ranks have started)."""
    choice("schedule", schedule, SCHEDULES)
    placement = SCHEDULES[schedule][1]
    if placement == "single":
        if stages_per_rank not in (None, 1):
            raise PpsplitError(
                f"schedule={schedule} runs one stage per rank, not schedule.stages_per_rank={stages_per_rank}; "
                "use interleaved_1f1b, looped_bfs, interleaved_zb, zbv or dualpipev for more"
            )
        per_rank = 1
    else:
        per_rank = 2 if stages_per_rank is None else stages_per_rank
        if placement == "v" and per_rank != 2:
            raise PpsplitError(
                f"schedule={schedule} needs exactly 2 stages per rank (V placement), "
                f"not schedule.stages_per_rank={per_rank}"
            )
        if stages % per_rank:
            raise PpsplitError(
                f"stages={stages} is not divisible by schedule.stages_per_rank={per_rank}; "
                f"allowed: a multiple of {per_rank}"
            )
    ranks = stages // per_rank
    if placement != "single" and microbatches < ranks:
        raise PpsplitError(
            f"microbatches={microbatches}: schedule={schedule} needs microbatches >= ranks ({ranks})"
        )
    if schedule in ("1f1b", "dualpipev") and microbatches < stages and ranks > 1:
        raise PpsplitError(
            f"microbatches={microbatches}: schedule={schedule} needs microbatches >= stages ({stages})"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise PpsplitError(
                f"microbatches={microbatches}: schedule={schedule} needs a multiple of "
                f"max(1, microbatches // ranks) = {rounds}; allowed e.g. {ranks * rounds} or {ranks * (rounds + 1)}"
            )
    return RankPlan(ranks, per_rank, placement)


def stages_of_rank(rank: int, ranks: int, per_rank: int, placement: str) -> list[int]:
    """The stage indices pipeline rank ``rank`` runs: loop placement gives rank r stages r, r+R,
    ...; V placement gives it stages r and 2R-1-r, so the first and last stage share rank 0."""
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]
