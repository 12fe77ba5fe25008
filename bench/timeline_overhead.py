"""What recording the timeline costs, side by side in one run.

The recorder (:mod:`ppsplit.report.timeline`) wraps each stage's schedule entry points, and the
schedules' wait on their sends and receives. Its cost is what a wrapper adds to a call:
measured on an action (and a wait) that does nothing, through the wrapper and without it,
interleaved (many calls a sample). Against it stands a real action: a block of
GPT2's width at the default microbatch, forward and backward, one thread. The share of a step
is the added time of a 1F1B step's actions (a forward and a backward per microbatch), each with a
wait, over that step's compute. ``ratio``: the recorded no-op's time over the plain one's.
"""

from __future__ import annotations

import statistics

from bench import harness

NAME = "timeline_overhead"
FULL = dict(hidden=256, seq=128, batch=4, repeats=15, inner=20)
QUICK = dict(hidden=64, seq=32, batch=2, repeats=3, inner=2)
MICROBATCHES = 4


class _Noop:
    def forward_one_chunk(self, chunk, *args, **kwargs):
        return None

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return None

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        return None


class _Work:
    def wait(self):
        return True


class _Stage:
    """The two entry points the schedules call, doing a block's worth of work."""

    def __init__(self, block, x):
        self.block, self.x, self.out = block, x, None

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.out = self.block(self.x)
        return self.out

    def backward_one_chunk(self, chunk, *args, **kwargs):
        self.out.sum().backward()

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        pass


def _main(quick: bool, out_dir: str | None) -> dict:
    import torch

    from ppsplit.train.recorder import Recorder

    spec = QUICK if quick else FULL
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(spec["hidden"], 4, 4 * spec["hidden"], dropout=0.0, batch_first=True)
    x = torch.randn(spec["batch"], spec["seq"], spec["hidden"])
    plain = _Stage(block, x)
    recorder = Recorder(0)
    recorder.step_begin(0)

    def action(stage):
        def run(_):
            stage.forward_one_chunk(0)
            stage.backward_one_chunk(0)
        return run

    noop_plain, noop_wrapped = _Noop(), _Noop()
    recorder.wrap(noop_wrapped, 1)

    def calls(stage):
        def run(_):
            for _ in range(100):
                stage.forward_one_chunk(0)
            if len(recorder.events) > 10000:  # bounded, as the recorder's first steps are
                recorder.events.clear()
        return run

    from torch.distributed.pipelining import schedules

    works = [_Work()]

    def waits(wait):
        def run(_):
            for _ in range(100):
                wait(works)
            if len(recorder.waits) > 10000:
                recorder.waits.clear()
        return run

    cases = {"noop_plain": harness.Case(calls(noop_plain), inner=spec["inner"]),
             "noop_recorded": harness.Case(calls(noop_wrapped), inner=spec["inner"]),
             "wait_plain": harness.Case(waits(schedules._wait_batch_p2p.original), inner=spec["inner"]),
             "wait_recorded": harness.Case(waits(schedules._wait_batch_p2p), inner=spec["inner"]),
             "block": harness.Case(action(plain), inner=2)}
    samples = harness.interleaved(cases, spec["repeats"])
    sides = {k: harness.summary(v) for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}
    per_action = max(0.0, (med["noop_recorded"] - med["noop_plain"]) / 100)
    per_wait = max(0.0, (med["wait_recorded"] - med["wait_plain"]) / 100)
    step_s = MICROBATCHES * med["block"]  # one stage's compute in a 1F1B step
    data = {
        "quick": quick, "threads": 1, "shape": [spec["batch"], spec["seq"], spec["hidden"]], "seconds": sides,
        "overhead_per_action_s": per_action, "overhead_per_wait_s": per_wait, "block_fwd_bwd_s": med["block"],
        "share_of_step": (per_action + per_wait) * 2 * MICROBATCHES / step_s,
        "ratio": med["noop_recorded"] / med["noop_plain"],
        "warnings": harness.noise_warnings(NAME, sides),
    }
    print(harness.table(["side", "a sample (median [min, max])"],
                        [[k, harness.fmt_stats(sides[k])] for k in cases]))
    print(f"recording: {per_action * 1e6:.1f} us an action, {per_wait * 1e6:.1f} us a wait, "
          f"{data['share_of_step'] * 100:.2f}% of a 1F1B step's "
          f"compute at m={MICROBATCHES}; recorded/plain {data['ratio']:.3f}")
    harness.write_json(NAME, data, out_dir)
    return data


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(1):
        return _main(quick, out_dir)


if __name__ == "__main__":
    main()
