"""A step's loss is the unsplit model's on the whole global batch in one forward, however the
batch is cut (ppsplit/train/objective.py): one microbatch, four, two accumulated batches, two
data-parallel ranks, two tensor-parallel ranks, four stages. Each model here scores a count of
tokens that varies from row to row: BERT's masked LM on a local corpus, a model=hf masked LM, and
LLaMA on padded rows. The old rule, a mean of the microbatches' means, must fail the check."""

import json

import pytest
import torch

from helpers import compose_cfg
from ppsplit.models import build
from ppsplit.train.objective import Objective
from ppsplit.app.cli import run

# How the same global batch of 8 is cut; m1 runs inline (a pipeline schedule needs a microbatch
# per stage), the others on local ranks.
CUTS = {
    "m1": ["launcher=inline", "microbatches=1"],
    "m4": ["microbatches=4"],
    "accumulated": ["batch_size=4", "train.grad_accumulation=2", "microbatches=2"],
    "dp2": ["microbatches=4", "parallel.dp=2"],
    "tp2": ["microbatches=4", "parallel.tp=2"],
    "stages4": ["microbatches=4", "stages=4"],
}
ROBERTA = ["model=hf", "model.model_class=RobertaForMaskedLM", "+model.config.num_hidden_layers=4",
           "+model.config.hidden_size=32", "+model.config.intermediate_size=64",
           "+model.config.num_attention_heads=2", "+model.config.vocab_size=500",
           "+model.config.max_position_embeddings=64"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from ppsplit.data.toy_corpus import make

    folder = tmp_path_factory.mktemp("toy")
    text, tokenizer = make(str(folder), kb=30, vocab=400)
    return ["data=text", f"data.path={text}", f"data.tokenizer={tokenizer}", f"data.cache_dir={folder / 'cache'}",
            "model.config.vocab_size=400"]


def args_of(model, corpus):
    """The model's overrides, and whether its batches are indexed by sample (so that two
    accumulated batches of 4 are the same samples as one of 8)."""
    if model == "bert":
        return ["model=bert", *corpus], True
    if model == "hf":
        return ROBERTA, False
    return ["model=llama", "data.padded=true"], False


def first_step(folder):
    data = json.loads((folder / "report.json").read_text())
    r = data["run"]
    assert data["ok"] and r["ok"], r["mismatch"]
    return r


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert", "hf", "llama"])
def test_the_first_step_is_the_whole_batchs_however_it_is_cut(tmp_path, model, corpus):
    common, by_sample = args_of(model, corpus)
    runs = {}
    for name, cut in CUTS.items():
        if name == "tp2" and model == "hf":
            continue  # transformers ships no tensor-parallel plan for RoBERTa (BERT's is in its config)
        assert run(compose_cfg(*common, "steps=1", "batch_size=8", *cut), str(tmp_path / name)) == 0, name
        runs[name] = first_step(tmp_path / name)
    for name, r in runs.items():  # each against the unsplit model on its step's batches in one forward
        assert r["losses"][0] == pytest.approx(r["reference_losses"][0], rel=1e-6), name
        assert r["grad_norms"][0] == pytest.approx(r["reference_grad_norms"][0], rel=1e-5), name
    whole = runs["m1"]
    for name, r in runs.items():
        if name == "accumulated" and not by_sample:
            continue  # synthetic batches are drawn per batch index: two of 4 are other samples
        assert r["losses"][0] == pytest.approx(whole["losses"][0], rel=1e-6), name
        assert r["grad_norms"][0] == pytest.approx(whole["grad_norms"][0], rel=1e-5), name


@pytest.mark.parametrize("model", ["hf", "llama"])
def test_the_loss_is_the_models_own_over_every_scored_token(model, corpus):
    """The anchor is transformers' own loss (labels=...): the mean over the scored tokens of the
    whole batch. A mean of the halves' means differs, since the halves score different counts."""
    common, _ = args_of(model, corpus)
    from ppsplit.data.corpus import BatchSource
    from ppsplit.config.spec import from_config

    spec = from_config(compose_cfg(*common))
    m = spec.model
    net = build.build_model(m.class_name, m.config, m.pretrained, seed=0)
    batch = BatchSource(spec, net.config).batch(0)
    objective = Objective(m.loss)
    halves = batch.microbatches(2)
    assert objective.count(halves[0].labels) != objective.count(halves[1].labels)
    with torch.no_grad():
        own = net(*batch.args, labels=batch.labels).loss
        parts = [objective.total(net(*h.args, **h.kwargs), h.labels) for h in halves]
        means = [objective(net(*h.args, **h.kwargs), h.labels) for h in halves]
    whole = sum(parts) / objective.count(batch.labels)
    assert float(whole) == pytest.approx(float(own), rel=1e-6)
    assert float(sum(means) / 2) != pytest.approx(float(own), rel=1e-5)  # near ln(vocab) at random init


@pytest.mark.slow
def test_a_mean_of_microbatch_means_fails_the_check(tmp_path, corpus):
    code = run(compose_cfg("model=bert", *corpus, "steps=1", "debug.defect=mean_of_means"), str(tmp_path))
    data = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and not data["ok"] and not data["run"]["ok"]
    assert data["run"]["mismatch"]["max_abs_diff"] > data["run"]["mismatch"]["bound"]


@pytest.mark.slow
def test_validation_loss_is_weighted_by_token_over_all_held_out_batches(tmp_path):
    """Held-out batches that score different counts: the pipeline's validation loss at dp=2 is the
    unsplit model's over every held-out token (the reference evaluates each batch whole)."""
    code = run(compose_cfg("model=llama", "data.padded=true", "steps=1", "parallel.dp=2", "eval.batches=3"),
               str(tmp_path))
    r = first_step(tmp_path)
    assert code == 0
    assert r["val_losses"][0]["loss"] == pytest.approx(r["reference_val_losses"][0]["loss"], rel=1e-6)
