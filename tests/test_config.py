"""Every option of every config group composes into a config the job accepts."""

import os

import pytest

from ppsplit.app.cli import CONF_DIR, check_config

GROUPS = {
    group: sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))
    for group in sorted(os.listdir(CONF_DIR)) if os.path.isdir(os.path.join(CONF_DIR, group))
}
OPTIONS = [(g, o) for g, opts in GROUPS.items() for o in opts]
TINY_QWEN2 = ["model.model_class=Qwen2ForCausalLM", "+model.config.num_hidden_layers=2",
              "+model.config.hidden_size=32", "+model.config.intermediate_size=64",
              "+model.config.num_attention_heads=2", "+model.config.num_key_value_heads=1",
              "+model.config.vocab_size=500"]
EXTRA = {("split", "manual"): ["split.points=[transformer.h.2]"], ("model", "hf"): TINY_QWEN2,
         **{("data", kind): [f"data.path=corpus.{kind}"] for kind in ("text", "jsonl", "parquet", "sft")}}


def test_groups_are_the_documented_ones():
    assert {"model", "split", "schedule", "launcher", "data", "peft"} <= set(GROUPS)
    assert {"gpt2", "llama", "bert", "t5", "hf", "qwen2_moe", "bart", "vit", "albert"} <= set(GROUPS["model"])
    assert {"even", "manual"} <= set(GROUPS["split"])
    assert {"gpipe", "1f1b"} <= set(GROUPS["schedule"])
    assert "inline" in GROUPS["launcher"]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes(cfg_for, group, option):
    cfg = cfg_for(f"{group}={option}", *EXTRA.get((group, option), []))
    assert cfg[group].name == option
    check_config(cfg)
    for key in ("stages", "microbatches", "batch_size", "seq_len", "seed", "steps"):
        assert key in cfg


@pytest.mark.parametrize("option", GROUPS["model"])
def test_model_option_builds_tiny_model(cfg_for, option):
    from ppsplit.models import build
    from ppsplit.train.objective import Objective
    from ppsplit.config.spec import from_config

    s = from_config(cfg_for(f"model={option}", *EXTRA.get(("model", option), []))).model
    model = build.build_model(s.class_name, s.config, None, seed=0)
    assert type(model).__name__ == s.class_name
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny: the suite stays fast
    Objective(s.loss)


def test_model_config_field_overrides(cfg_for):
    from ppsplit.config.spec import from_config

    cfg = cfg_for("model=gpt2", "model.config.n_layer=6")
    assert from_config(cfg).model.config["n_layer"] == 6
