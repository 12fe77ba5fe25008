"""Shared set-up for tests: the tiny models exactly as the real configs describe them."""

from hydra import compose, initialize_config_dir

from ppsplit.models import build
from ppsplit.data.batch import make_batch
from ppsplit.train.objective import Objective
from ppsplit.app.cli import CONF_DIR
from ppsplit.config.spec import from_config


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def model_and_batch(name, *overrides, seed=0):
    """(model, microbatches, loss_fn) for model config ``name``."""
    cfg = compose_cfg(f"model={name}", *overrides)
    s = from_config(cfg).model
    model = build.build_model(s.class_name, s.config, s.pretrained, seed=seed)
    batch = make_batch(s.inputs, model, cfg.batch_size, cfg.seq_len, cfg.seed,
                             call_kwargs=s.call_kwargs)
    return model, batch.microbatches(cfg.microbatches), Objective(s.loss)
