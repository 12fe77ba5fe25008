"""Training for real: local corpora through a local tokenizer, the stream indexed by sample,
schedules, accumulation, clipping across ranks, bf16 and recomputation, evaluation, metrics,
and one-line refusals of what cannot train. The corpus and tokenizer are made here
(ppsplit.data.toy_corpus: the standard library's docstrings and a BPE trained on them)."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import run_cli
from helpers import compose_cfg
from ppsplit.app.cli import run


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A 60 KB corpus as .txt, .jsonl and .parquet (the same documents), its tokenizer, a cache."""
    from ppsplit.data.toy_corpus import make

    folder = tmp_path_factory.mktemp("toy")
    corpus, tokenizer = make(str(folder), kb=60, vocab=500)
    docs = [d for d in open(corpus).read().split("\n\n") if d.strip()]
    with open(folder / "corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"body": doc}) + "\n")
    import datasets

    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(folder / "corpus.parquet"))
    return {"folder": folder, "txt": corpus, "tokenizer": tokenizer, "cache": str(folder / "cache")}


def data_args(toy, kind="text", path=None, vocab=True):
    args = [f"data={kind}", f"data.path={path or toy['txt']}", f"data.tokenizer={toy['tokenizer']}",
            f"data.cache_dir={toy['cache']}"]
    return args + (["model.config.vocab_size=500"] if vocab else [])


def report(folder):
    return json.loads((folder / "report.json").read_text())


def test_the_stream_is_indexed_by_sample_and_every_loader_packs_the_same_blocks(toy):
    from ppsplit.data.corpus import BatchSource, TokenBlocks, prepare
    from ppsplit.config.spec import from_config

    paths = {}
    for kind, path, field in (("text", toy["txt"], "text"), ("jsonl", toy["folder"] / "corpus.jsonl", "body"),
                              ("parquet", toy["folder"] / "corpus.parquet", "text")):
        spec = from_config(compose_cfg(*data_args(toy, kind, path), f"data.field={field}",
                                       *(["data.sample_by=paragraph"] if kind == "text" else [])))
        paths[kind] = prepare(spec.data, None, spec.seq_len, spec.seed, 500)
    blocks = {k: TokenBlocks(p, 0) for k, p in paths.items()}
    assert np.array_equal(blocks["text"].train, blocks["jsonl"].train)
    assert np.array_equal(blocks["text"].train, blocks["parquet"].train)
    meta = blocks["text"].meta
    assert meta["val_documents"] >= 1 and len(blocks["text"].val) >= 1 and meta["documents"] > 50

    spec = from_config(compose_cfg(*data_args(toy)))
    config = type("C", (), {"vocab_size": 500})()
    whole = BatchSource(spec, config, paths["text"])
    resumed = BatchSource(spec, config, paths["text"], first_index=3, first_sample=whole.sample_of(3))
    assert torch.equal(whole.batch(5).args[0], resumed.batch(5).args[0])  # the same samples, after a resume
    b = whole.batch(0)
    halves = [b.shard(i, 2).args[0] for i in range(2)]
    assert torch.equal(torch.cat(halves), b.args[0])  # data-parallel ranks: a share each, all of it
    n = len(blocks["text"].train)  # past an epoch the order is a new permutation of the same blocks
    epoch = torch.cat([whole.batch(i).args[0] for i in range(n // spec.batch_size)])
    assert len({tuple(r) for r in epoch.tolist()}) == len(epoch)


def test_masked_and_denoising_objectives_are_seeded_per_sample(toy):
    from ppsplit.data.corpus import make_inputs

    tokens = np.random.default_rng(0).integers(5, 500, size=(64, 32)).astype(np.int32)
    config = type("C", (), {"vocab_size": 500, "decoder_start_token_id": 0})()
    ids = np.arange(64)
    a = make_inputs("masked_lm", tokens, ids, config, 0, {}, mask_token_id=3, unk_token_id=1)
    b = make_inputs("masked_lm", tokens, ids, config, 0, {}, mask_token_id=3, unk_token_id=1)
    assert torch.equal(a.args[0], b.args[0]) and torch.equal(a.labels, b.labels)
    scored = a.labels != -100
    assert 0.12 < scored.float().mean() < 0.19 and bool(scored.any(1).all())
    original = torch.from_numpy(tokens).long()
    masked = (a.args[0] == 3) & scored
    kept = (a.args[0] == original) & scored
    assert 0.7 < masked.sum() / scored.sum() < 0.9 and 0.04 < kept.sum() / scored.sum() < 0.2
    assert torch.equal(a.labels[scored], original[scored])
    s2s = make_inputs("seq2seq", tokens, ids, config, 0, {}, mask_token_id=None, unk_token_id=1)
    assert torch.equal(s2s.labels, original) and bool((s2s.args[0] == 1).any())
    assert torch.equal(s2s.kwargs["decoder_input_ids"][:, 1:], original[:, :-1])


def test_lr_schedules_warm_up_and_decay_to_the_floor():
    from ppsplit.train.optim import lr_factor

    assert [lr_factor(s, "constant", 4, 20, 0.0) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(19, "linear", 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(19, "cosine", 4, 20, 0.0) == pytest.approx(0.0, abs=1e-12)
    mid = lr_factor(4 + 15 // 2, "cosine", 4, 20, 0.0)
    assert 0.4 < mid < 0.6 and lr_factor(4, "cosine", 4, 20, 0.0) == 1.0


def test_weight_decay_applies_to_matrices_only():
    from ppsplit.train.optim import make_optimizer

    layer = torch.nn.Linear(4, 4)
    norm = torch.nn.LayerNorm(4)
    opt = make_optimizer({"name": "adamw", "lr": 1e-3, "weight_decay": 0.1},
                         list(layer.named_parameters()) + list(norm.named_parameters()))
    decays = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays[id(layer.weight)] == 0.1 and decays[id(layer.bias)] == 0.0 and decays[id(norm.weight)] == 0.0


def test_accumulating_two_batches_is_one_batch_of_both(tmp_path, toy):
    """The same samples in one step: two accumulated batches of 8, or one of 16."""
    common = data_args(toy) + ["launcher=inline", "steps=3", "optimizer=adamw"]
    assert run(compose_cfg(*common, "batch_size=8", "train.grad_accumulation=2"), str(tmp_path / "acc")) == 0
    assert run(compose_cfg(*common, "batch_size=16"), str(tmp_path / "one")) == 0
    acc, one = report(tmp_path / "acc")["run"], report(tmp_path / "one")["run"]
    assert acc["ok"] and acc["train"]["grad_accumulation"] == 2
    assert acc["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert acc["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)


@pytest.mark.slow
def test_clipping_that_bites_matches_the_unsplit_model_step_for_step_at_pp2_dp2(tmp_path, toy):
    code = run(compose_cfg(*data_args(toy), "parallel.dp=2", "steps=4", "optimizer=adamw", "verify=full",
                           "train.clip_grad_norm=0.25", "train.lr_schedule=linear", "train.warmup_steps=2",
                           "metrics.tensorboard=true", "eval.every=2"), str(tmp_path))
    data = report(tmp_path)
    r = data["run"]
    assert code == 0 and r["ok"] and r["mesh"]["fsdp"] and r["verify"]["reference_steps"] == 4
    assert r["clipped_steps"] == 4 and min(r["grad_norms"]) > 0.25  # it bit every step
    assert r["grad_norms"] == pytest.approx(r["reference_grad_norms"], rel=1e-4)
    assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
    assert r["lrs"][:2] == pytest.approx([5e-4, 1e-3]) and r["lrs"][3] < r["lrs"][2]
    assert [v["step"] for v in r["val_losses"]] == [2, 4] == [v["step"] for v in r["reference_val_losses"]]
    assert data["data"]["name"] == "text" and data["data"]["train_blocks"] > 0
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,lr,grad_norm,tokens_per_s,mfu") and len(rows) == 5
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert r["metrics"]["tokens_per_s"] > 0 and 0 < r["metrics"]["mfu"] < 1


@pytest.mark.slow
def test_bf16_with_activation_checkpointing_matches_the_unsplit_bf16_model(tmp_path):
    code = run(compose_cfg("model=llama", "train.precision=bf16", "train.activation_checkpointing=blocks",
                           "optimizer=adamw", "steps=3"), str(tmp_path / "ac"))
    r = report(tmp_path / "ac")["run"]
    assert code == 0 and r["ok"] and r["train"]["precision"] == "bf16"
    assert r["max_loss_rel_diff"] <= 2e-2  # the bf16 level (ppsplit/stages/tolerance.py)
    code = run(compose_cfg("model=llama", "train.precision=bf16", "optimizer=adamw", "steps=3"), str(tmp_path / "no"))
    plain = report(tmp_path / "no")["run"]
    assert code == 0 and r["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # recomputing changes nothing


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_masked_and_encoder_decoder_models_train_on_text(tmp_path, toy, model):
    overrides = data_args(toy) + [f"model={model}", "launcher=inline", "steps=2"]
    assert run(compose_cfg(*overrides), str(tmp_path)) == 0
    r = report(tmp_path)["run"]
    assert r["ok"] and all(math.isfinite(v["loss"]) for v in r["val_losses"])


BAD = [
    (lambda t: ["data.path=/nowhere/*.txt"], "data.path='/nowhere/*.txt': no such file"),
    (lambda t: [f"data.path={t['folder'] / 'empty.txt'}"], "hold no text"),
    (lambda t: ["data=jsonl", f"data.path={t['folder'] / 'corpus.jsonl'}", "data.field=text"],
     "data.field='text' is not in corpus.jsonl's records; allowed: body"),
    (lambda t: [f"data.tokenizer={t['folder']}"], "does not load as a tokenizer"),
    (lambda t: ["model.config.vocab_size=100"], "has 500 tokens, more than the model's vocab_size=100"),
    (lambda t: ["seq_len=500"], "seq_len=500 is beyond the model's max_position_embeddings=128"),
    (lambda t: ["steps=3", "train.warmup_steps=5"], "train.warmup_steps=5 is longer than the run (steps=3)"),
    (lambda t: ["train.clip_grad_norm=0"], "train.clip_grad_norm=0: allowed: a number > 0"),
    (lambda t: ["model=vit"], "ViTForImageClassification takes images, and trains on data=synthetic only"),
]
NO_VOCAB = {"ViTForImageClassification takes images, and trains on data=synthetic only"}  # no vocabulary to set


@pytest.mark.parametrize("make,expect", BAD, ids=[b[1][:40] for b in BAD])
def test_what_cannot_train_is_refused_in_one_line_before_any_rank(tmp_path, toy, make, expect):
    (toy["folder"] / "empty.txt").write_text("\n\n  \n")
    args = data_args(toy, vocab=expect not in NO_VOCAB) + make(toy)
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-1500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppsplit: error: ") and expect in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_resumed_run_continues_the_stream_at_the_next_sample(tmp_path, toy):
    common = data_args(toy) + ["launcher=inline", "optimizer=adamw"]
    assert run(compose_cfg(*common, "steps=4"), str(tmp_path / "whole")) == 0
    assert run(compose_cfg(*common, "steps=2", "checkpoint.save=true", f"checkpoint.dir={tmp_path / 'ck'}"),
               str(tmp_path / "first")) == 0
    meta = json.loads((tmp_path / "ck" / "ppsplit.json").read_text())
    assert meta["data"]["next_sample"] == 2 * 8 and meta["data"]["name"] == "text"
    assert run(compose_cfg(*common, "steps=2", f"checkpoint.load={tmp_path / 'ck'}"), str(tmp_path / "second")) == 0
    whole = report(tmp_path / "whole")["run"]["losses"]
    parts = report(tmp_path / "first")["run"]["losses"] + report(tmp_path / "second")["run"]["losses"]
    assert parts == whole  # bitwise: the same samples, the same steps


def test_each_gradient_element_counts_once_in_the_norm_whatever_its_placement():
    """optim._share: a shard counts on its rank, a replica at coordinate 0 of each dimension it
    is replicated over (a plain tensor is replicated over all), FSDP's strided shard as a shard;
    a partial placement is not summed by squares."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ppsplit.train.optim import _share

    class Sharded:  # a DTensor's interface, as _share reads it
        def __init__(self, names, placements):
            self.device_mesh = type("Mesh", (), {"mesh_dim_names": names})()
            self.placements = placements

        def to_local(self):
            return torch.ones(2)

    fsdp_tp = Sharded(("dp", "tp"), (_StridedShard(0, split_factor=2), Shard(0)))
    norm_under_fsdp = Sharded(("dp",), (Shard(0),))
    tp_only = Sharded(("tp",), (Replicate(),))
    for dp in (0, 1):
        for tp in (0, 1):
            at = {"dp": dp, "tp": tp}
            assert _share(fsdp_tp, at)[1]  # sharded over both: every rank counts its part
            assert _share(norm_under_fsdp, at)[1] == (tp == 0)  # replicated over tp
            assert _share(tp_only, at)[1] == (dp == 0 and tp == 0)
            assert _share(torch.ones(2), at)[1] == (dp == 0 and tp == 0)
    assert _share(Sharded(("tp",), (Partial(),)), {"dp": 0, "tp": 0}) is None


def test_more_local_ranks_than_visible_gpus_is_refused_in_one_line():
    from ppsplit import PpsplitError
    from ppsplit.app.checks import check_local_gpus

    check_local_gpus("local", 4, visible=0)  # CPU ranks: as many as asked
    check_local_gpus("local", 2, visible=2)
    check_local_gpus("slurm", 8, visible=1)  # SLURM places ranks on nodes (launcher.gpus_per_task)
    with pytest.raises(PpsplitError, match="this run needs 4 ranks, one GPU each, and 2 GPU.s. are visible"):
        check_local_gpus("local", 4, visible=2)


def test_mfu_divides_by_the_peaks_the_ranks_measured_on_their_devices(tmp_path):
    from ppsplit.config.spec import from_config
    from ppsplit.train.metrics import MetricsLog, matmul_peak

    spec = from_config(compose_cfg("metrics.csv=false", "metrics.plot=false"))
    log = MetricsLog(str(tmp_path), spec, flops_per_step=1e9, peak_flops=None, ranks=2)
    log.record(0, 1.0, 0.1, 1.0, time_s=1.0)  # no rank has said its peak yet: no MFU
    log.record(1, 1.0, 0.1, 1.0, time_s=1.0, peak_flops=4e9)  # two ranks, 2e9 FLOP/s each
    assert [r["mfu"] for r in log.rows] == [None, 0.25] and log.summary()["peak_flops_per_rank"] == 2e9
    assert matmul_peak(1, size=64, seconds=0.01, precision="bf16") > 0  # a rank training in bf16
