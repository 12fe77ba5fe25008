"""The verdict: a correct pipeline never says FAILED, and a wrong one always does. One rule
(ppsplit/stages/tolerance.py) for outputs, losses, gradients, trained tensors and tied copies; dropout
off for the comparison, or drawn alike on both sides; defects injected into real ranks fail."""

import json

import pytest
import torch

from conftest import run_cli
from helpers import compose_cfg
from ppsplit.app.cli import run
from ppsplit.stages.tolerance import Tolerance, tensor_difference


def report(folder):
    return json.loads((folder / "report.json").read_text())


def test_the_rule_is_relative_to_the_tensors_scale():
    rule = Tolerance(1e-5)
    grad = torch.full((4, 4), 150.0)
    assert tensor_difference("w", "gradient", grad + 1.5e-5, grad, rule).ok  # 1e-7 of its scale
    small = torch.full((4, 4), 1e-3)
    assert not tensor_difference("w", "gradient", small * 1.5, small, rule).ok  # half a contribution off
    near_zero = torch.tensor([4.0, 1e-9])  # a near-cancelling entry carries its terms' rounding
    assert tensor_difference("w", "gradient", near_zero + torch.tensor([0.0, 3e-7]), near_zero, rule).ok
    zero = torch.zeros(3)
    assert tensor_difference("w", "gradient", zero, zero, rule).ok
    assert not tensor_difference("w", "gradient", zero + 1e-6, zero, rule).ok


@pytest.mark.slow
@pytest.mark.parametrize("defect,kind", [
    ("unsynced_tie", "tie copy"), ("dropped_stage_grad", "gradient"),
    ("repeated_microbatch", None), ("perturbed_weight", None),
])
def test_an_injected_defect_fails_the_run_naming_the_tensor(tmp_path, defect, kind):
    code = run(compose_cfg("model=gpt2", f"debug.defect={defect}"), str(tmp_path))
    data = report(tmp_path)
    assert code == 1 and not data["ok"] and not data["run"]["ok"]
    mismatch = data["run"]["mismatch"]
    assert mismatch is not None and not mismatch["ok"]
    assert mismatch["max_abs_diff"] is None or mismatch["max_abs_diff"] > mismatch["bound"]
    if kind:
        assert mismatch["kind"] == kind, mismatch
    assert mismatch["tie_copy"] == (mismatch["kind"] == "tie copy")


# Classes whose defaults have dropout, at tiny sizes: only the size is given, never the dropout.
DROPOUT_CLASSES = {
    "OPTForCausalLM": ["num_hidden_layers=2", "hidden_size=32", "ffn_dim=64", "num_attention_heads=2",
                       "word_embed_proj_dim=32", "vocab_size=500", "max_position_embeddings=64"],
    "RobertaForMaskedLM": ["num_hidden_layers=2", "hidden_size=32", "intermediate_size=64",
                           "num_attention_heads=2", "vocab_size=500", "max_position_embeddings=64"],
    "DistilBertForMaskedLM": ["n_layers=2", "dim=32", "hidden_dim=64", "n_heads=2", "vocab_size=500",
                              "max_position_embeddings=64"],
    "PegasusForConditionalGeneration": ["encoder_layers=2", "decoder_layers=2", "d_model=32",
                                        "encoder_ffn_dim=64", "decoder_ffn_dim=64", "encoder_attention_heads=2",
                                        "decoder_attention_heads=2", "vocab_size=500",
                                        "max_position_embeddings=64"],
    "GPTNeoXForCausalLM": ["num_hidden_layers=2", "hidden_size=32", "intermediate_size=64",
                           "num_attention_heads=2", "vocab_size=500", "max_position_embeddings=64",
                           "hidden_dropout=0.1", "attention_dropout=0.1"],  # its defaults have none
}


def hf_args(cls):
    return ["model=hf", f"model.model_class={cls}", *[f"+model.config.{kv}" for kv in DROPOUT_CLASSES[cls]]]


@pytest.mark.parametrize("model", ["hf"])
@pytest.mark.parametrize("cls", list(DROPOUT_CLASSES))
def test_a_class_with_dropout_passes_with_no_extra_overrides(tmp_path, model, cls):
    proc = run_cli(*hf_args(cls), "launcher=inline", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "dropout off for the check and the training (p=0.1 in the config:" in proc.stdout
    data = report(tmp_path / "run")
    assert data["numerics"]["ok"] and data["run"]["ok"] and data["numerics"]["forward_max_abs_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf"])
@pytest.mark.parametrize("cls", ["OPTForCausalLM", "RobertaForMaskedLM", "DistilBertForMaskedLM"])
def test_dropout_on_draws_the_same_masks_in_the_stages_and_the_unsplit_model(tmp_path, model, cls):
    off = run(compose_cfg(*hf_args(cls), "stages=2"), str(tmp_path / "off"))
    on = run(compose_cfg(*hf_args(cls), "stages=2", "dropout=true"), str(tmp_path / "on"))
    assert off == 0 and on == 0
    a, b = report(tmp_path / "off")["run"], report(tmp_path / "on")["run"]
    assert b["ok"] and b["max_loss_rel_diff"] <= 1e-5 and b["grad_max_abs_diff"] <= 1e-5
    assert a["losses"] != b["losses"]  # the dropout did act


def test_dropout_with_tensor_parallelism_is_refused(tmp_path):
    from ppsplit import PpsplitError

    with pytest.raises(PpsplitError, match="dropout=true with parallel.tp=2: a tensor-parallel rank draws"):
        run(compose_cfg("model=llama", "parallel.tp=2", "dropout=true", "+model.config.attention_dropout=0.1"),
            str(tmp_path))


def test_a_gradient_that_is_only_rounding_is_compared_at_its_modules_scale():
    from ppsplit.stages.verify import gradient_scales_by_module

    ref = {"a.key.weight": torch.full((2, 2), 0.5), "a.key.bias": torch.tensor([4e-8, -3e-8]),
           "a.query.weight": torch.full((2, 2), 0.4), "a.query.bias": torch.tensor([0.3, -0.2])}
    scales = gradient_scales_by_module(ref)
    assert scales == pytest.approx({"a.key": 0.5, "a.query": 0.4})
    rule = Tolerance(2e-2)  # bf16's
    noisy = ref["a.key.bias"] + 1.25e-7  # softmax is blind to the key bias: its gradient is rounding
    assert not tensor_difference("a.key.bias", "gradient", noisy, ref["a.key.bias"], rule).ok
    assert tensor_difference("a.key.bias", "gradient", noisy, ref["a.key.bias"], rule, scales["a.key"]).ok
    dropped = torch.zeros(2)  # a bias gradient lost is still caught at its module's scale
    assert not tensor_difference("a.query.bias", "gradient", dropped, ref["a.query.bias"], rule,
                                 scales["a.query"]).ok
