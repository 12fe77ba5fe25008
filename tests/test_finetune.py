"""Fine-tuning: instruction and chat records (data=sft) with answer-only loss, packing, LoRA
adapters (peft=lora), and the refusals. The records and the tokenizer with its chat template are
made here. The README's fine-tuning command (tests/test_readme.py) is the run over a pretrained
base on two ranks: it checks the packed chat rows, the held-out answer loss, the adapter folder,
the merged model and the base folder left as it was."""

import json

import pytest
import torch

from conftest import run_cli
from helpers import compose_cfg
from ppsplit import PpsplitError

VOCAB = 400


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Chat and prompt/completion records, a tokenizer with a chat template, a cache."""
    from ppsplit.data.toy_corpus import make

    folder = tmp_path_factory.mktemp("sft")
    _, tokenizer = make(str(folder), kb=30, vocab=VOCAB, chat=160)
    return {"folder": folder, "tokenizer": tokenizer, "chat": str(folder / "chat.jsonl"),
            "prompts": str(folder / "prompts.jsonl"), "cache": str(folder / "cache")}


LLAMA = ("model=llama", f"model.config.vocab_size={VOCAB}")
QWEN2 = ("model=hf", "model.model_class=Qwen2ForCausalLM", "+model.config.num_hidden_layers=4",  # through model=hf
         "+model.config.hidden_size=64", "+model.config.intermediate_size=128", "+model.config.num_attention_heads=4",
         "+model.config.num_key_value_heads=2", f"+model.config.vocab_size={VOCAB}")


def sft_args(toy, records="chat", *extra, model=LLAMA):
    return [*model, "data=sft", f"data.path={toy[records]}", f"data.tokenizer={toy['tokenizer']}",
            f"data.cache_dir={toy['cache']}", "data.truncate=true", "seq_len=128", *extra]


def _spec(*overrides):
    from ppsplit.config.spec import from_config

    return from_config(compose_cfg(*overrides), list(overrides))


def _tokenizer(toy):
    from ppsplit.data.corpus import load_tokenizer

    return load_tokenizer(toy["tokenizer"])


def _records(path):
    import datasets

    return datasets.load_dataset("json", data_files=[path], split="train")


def test_only_the_answers_are_scored_in_both_formats(toy):
    from ppsplit.data.sft import tokenize_examples

    tok = _tokenizer(toy)
    chat = _records(toy["chat"])
    spec = _spec(*sft_args(toy)).data
    (ids, scored), = tokenize_examples(spec, chat.select([0]), tok, 128, "chat.jsonl")
    answer = chat[0]["messages"][2]["content"]
    assert tok.decode(ids[scored]) == answer + "<eos>\n"  # the answer and its end, not the header
    assert tok.decode(ids) == tok.apply_chat_template(chat[0]["messages"], tokenize=False)
    prompts = _records(toy["prompts"])
    (ids, scored), = tokenize_examples(spec, prompts.select([0]), tok, 128, "prompts.jsonl")
    assert tok.decode(ids[scored]) == prompts[0]["completion"] + "<eos>"
    every = _spec(*sft_args(toy), "data.loss_on=all").data
    (ids, scored), = tokenize_examples(every, chat.select([0]), tok, 128, "chat.jsonl")
    assert not scored[0] and scored[1:].all()  # an example's first token has nothing of its own before it


def test_packing_keeps_examples_whole_restarts_positions_and_scores_no_boundary():
    from ppsplit.data.sft import pack

    examples = [(torch.arange(n).numpy() + 10, (torch.arange(n) > 0).numpy()) for n in (5, 3, 7, 4, 2)]
    rows = pack(examples, 8, pad=0, packing=True)
    assert rows["ids"].shape == (3, 8)  # 21 tokens, best fit: 7+... in three rows of 8
    for ids, labels, pos in zip(rows["ids"], rows["labels"], rows["positions"]):
        starts = [i for i in range(8) if pos[i] == 0]
        for a, b in zip(starts, starts[1:] + [8]):
            assert list(pos[a:b]) == list(range(b - a))
            assert labels[a] == -100  # nothing before an example's first token is its own
    whole = []  # every example once, whole: a block that starts at token 10 is an example (padding is 0)
    for ids, pos in zip(rows["ids"], rows["positions"]):
        starts = [i for i in range(8) if pos[i] == 0] + [8]
        whole += [list(ids[a:b]) for a, b in zip(starts, starts[1:]) if ids[a] == 10]
    assert sorted(whole) == sorted([list(range(10, 10 + n)) for n in (5, 3, 7, 4, 2)])
    padded = pack(examples, 8, pad=0, packing=False)
    assert padded["ids"].shape == (5, 8) and [int(m.sum()) for m in padded["mask"]] == [5, 3, 7, 4, 2]


def test_a_packed_example_computes_what_it_computes_alone():
    """Restarting position ids, no attention mask, no cache: each example attends to itself."""
    from ppsplit.models import build

    s = _spec("model=llama").model
    model = build.build_model(s.class_name, s.config, seed=0).eval()
    a, b = torch.randint(0, 100, (1, 6)), torch.randint(0, 100, (1, 9))
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(6), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(row, position_ids=pos, use_cache=False).logits
        alone = model(b, use_cache=False).logits
    assert (packed[:, 6:] - alone).abs().max() < 1e-5


def test_lora_freezes_the_base_and_keeps_peft_names(toy):
    import ppsplit
    from ppsplit.data.batch import make_batch
    from ppsplit.models import build
    from ppsplit.train.optim import make_optimizer

    spec = _spec("model=llama", "peft=lora", "peft.r=4", "peft.target_modules=[q_proj,v_proj]")
    model = build.model_of(spec)
    names = {k for k, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A.default." in k or ".lora_B.default." in k for k in names)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in names
    batch = make_batch("causal_lm", model.config, 4, 16, 0, step=0, call_kwargs=spec.model.call_kwargs)
    mb = batch.microbatches(2)[0]
    split = ppsplit.split(model, args=mb.args, kwargs=mb.kwargs, stages=2)
    assert ppsplit.verify_fqns(model, split).ok
    held = {id(p) for g in make_optimizer(spec.optimizer, model.named_parameters()).param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("records,packing", [("prompts", "false")])
def test_padded_prompt_completion_rows_equal_the_unsplit_model_in_four_stages(toy, tmp_path, records, packing):
    proc = run_cli(*sft_args(toy, records), f"data.packing={packing}", "peft=lora",
                   "peft.target_modules=all-linear", "stages=4", "model.config.num_hidden_layers=4", "steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(tmp_path / "run" / "report.json"))["run"]["ok"]


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_at_another_layout(toy, tmp_path):
    """Two steps at pp2 saved, two more resumed at four stages: the checkpoint holds only the
    adapters and their optimizer state, and the resumed run passes its check from step 2."""
    from ppsplit.checkpoint.dcp import saved_keys

    common = [*sft_args(toy), "peft=lora", "peft.target_modules=[q_proj,v_proj]", "optimizer=adamw"]
    first = run_cli(*common, "steps=2", "checkpoint.save=true", f"checkpoint.dir={tmp_path / 'ck'}",
                    f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    keys = saved_keys(str(tmp_path / "ck"))
    assert keys and all(".lora_" in k for k in keys if not k.startswith("optim.param_groups")), sorted(keys)[:5]
    second = run_cli(*common, "steps=2", "stages=4", f"checkpoint.load={tmp_path / 'ck'}",
                     f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    run = json.load(open(tmp_path / "b" / "report.json"))["run"]
    assert run["ok"] and run["resumed_from"]["step"] == 2
    for changed, said in (("peft.alpha=32", "alpha=16.0 there, 32.0 here"), ("seed=1", "seed=0 there, 1 here")):
        other = run_cli(*common, "steps=2", changed, f"checkpoint.load={tmp_path / 'ck'}",
                        f"hydra.run.dir={tmp_path / 'c'}", cwd=tmp_path)
        lines = other.stderr.strip().splitlines()
        assert other.returncode == 2 and len(lines) == 1 and said in lines[0], other.stderr[-2000:]


LAYOUTS = [("llama", LLAMA, "parallel.dp=2", "1f1b"),  # FSDP2 units that mix the frozen base and the adapters
           ("gpt2", ("model=gpt2", f"model.config.vocab_size={VOCAB}"), "parallel.dp=1", "zbv"),  # a frozen tie, zero bubble
           ("qwen2", QWEN2, "parallel.dp=1", "1f1b")]  # a class named through model=hf (biased q, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("name,model,dp,schedule", LAYOUTS, ids=[f"{n}-{d}-{s}" for n, _, d, s in LAYOUTS])
def test_lora_equals_the_unsplit_model_under_fsdp2_and_zero_bubble(toy, tmp_path, name, model, dp, schedule):
    proc = run_cli(*sft_args(toy, "prompts", model=model), dp, f"schedule={schedule}", "peft=lora",
                   "data.val_fraction=0.2", "steps=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.load(open(tmp_path / "run" / "report.json"))["run"]
    assert run["ok"] and all(t["copies_bitwise_equal"] for t in run.get("ties") or [])


def test_a_tensor_parallel_plan_lays_out_the_adapters_beside_their_base_layers():
    """Beside a column-wise base, B is column-wise and A whole; beside a row-wise one, A is
    row-wise and B whole; an adapted embedding under a row-wise plan is refused by name."""
    from ppsplit.models import build
    from ppsplit.stages.shard_flow import adapter_plan
    from ppsplit.stages.shard_flow import tp_plan_of

    model = build.model_of(_spec("model=llama", "peft=lora", "peft.target_modules=all-linear"))
    plan = tp_plan_of(model)
    layer = "base_model.model.model.layers.1."
    assert plan[layer + "self_attn.q_proj.base_layer"] == plan[layer + "self_attn.q_proj.lora_B.default"] == "colwise"
    assert plan[layer + "mlp.down_proj.base_layer"] == plan[layer + "mlp.down_proj.lora_A.default"] == "rowwise"
    assert layer + "self_attn.q_proj.lora_A.default" not in plan and layer + "mlp.down_proj.lora_B.default" not in plan
    assert not any(k.endswith("self_attn.q_proj") for k in plan)  # the peft wrapper itself is not a leaf
    embedded = build.model_of(_spec("model=llama", "peft=lora", "peft.target_modules=[embed_tokens]"))
    with pytest.raises(PpsplitError, match="peft.target_modules takes model.embed_tokens, which parallel.tp lays "
                                           "out embedding_rowwise"):
        adapter_plan(embedded, {"model.embed_tokens": "embedding_rowwise"})


@pytest.fixture(scope="module")
def lora_pp2(toy, tmp_path_factory):
    """Two AdamW steps of LoRA on every linear layer at pp2, with the adapter folder."""
    return _lora_run(toy, tmp_path_factory.mktemp("pp2"))


def _lora_run(toy, folder, *extra):
    proc = run_cli(*sft_args(toy), "peft=lora", "peft.target_modules=all-linear", "optimizer=adamw", "steps=2",
                   "checkpoint.save=true", f"checkpoint.dir={folder / 'ck'}", "checkpoint.hf=true", *extra,
                   f"hydra.run.dir={folder / 'run'}", cwd=folder, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, json.load(open(folder / "run" / "report.json"))["run"]


@pytest.mark.slow
def test_lora_at_pp2_x_tp2_shards_the_adapters_and_exports_them_whole(toy, tmp_path, lora_pp2):
    """Every step equals the unsplit adapted model's; each rank holds part of the adapters'
    optimizer state; the adapter folder gathered from the shards equals the pp2 run's."""
    from safetensors.torch import load_file

    folder, run = _lora_run(toy, tmp_path, "parallel.tp=2")
    base_folder, base = lora_pp2
    assert run["ok"] and base["ok"] and run["mesh"]["tp"] == 2
    whole = {r["pp"]: r["optimizer_bytes"] for r in base["rank_layout"]}
    assert all(r["optimizer_bytes"] < 0.8 * whole[r["pp"]] for r in run["rank_layout"]), run["rank_layout"]
    mine, theirs = (load_file(f / "ck" / "hf" / "adapter_model.safetensors") for f in (folder, base_folder))
    assert mine.keys() == theirs.keys() and any(".lora_B." in k for k in mine)
    for key, tensor in theirs.items():
        assert mine[key].shape == tensor.shape and torch.allclose(mine[key], tensor, atol=1e-5), key


@pytest.mark.slow
def test_adapter_dropout_masks_are_drawn_alike_in_the_stages_and_the_unsplit_model(toy, tmp_path, lora_pp2):
    _, run = _lora_run(toy, tmp_path, "peft.dropout=0.1")
    _, still = lora_pp2
    assert run["ok"] and run["grad_max_abs_diff"] < 1e-6
    assert abs(run["losses"][1] - still["losses"][1]) > 1e-4  # the masks are drawn (B moved after step 1)


@pytest.mark.slow
def test_an_encoder_decoder_learns_completions_from_prompts_on_two_ranks(toy, tmp_path):
    """T5: the prompt to the encoder, the completion to the decoder's labels, padded rows with a
    mask; every step equals the unsplit adapted model's."""
    proc = run_cli("model=t5", "data=sft", f"data.path={toy['prompts']}", f"data.tokenizer={toy['tokenizer']}",
                   f"data.cache_dir={toy['cache']}", "data.packing=false", "data.truncate=true", "seq_len=64",
                   f"model.config.vocab_size={VOCAB}", "peft=lora", "peft.target_modules=[q,v]", "steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.load(open(tmp_path / "run" / "report.json"))
    assert report["run"]["ok"] and report["data"]["sft"]["format"] == "prompt_completion"


BAD = [
    (("data.prompt_field=question", "data.messages_field=turns"), "prompts", "neither 'turns' nor 'question'"),
    (("data.truncate=false", "seq_len=16"), "chat", "data.truncate=false: record 1 of chat.jsonl is"),
    (("peft=lora", "peft.target_modules=[nosuch]"), "chat", "peft.target_modules=['nosuch']"),
    (("peft=lora", "peft.r=0"), "chat", "peft.r=0"),
    (("peft=lora", "peft.merge=true"), "chat", "peft.merge=true"),
    (("peft=lora", "peft.dropout=0.1", "parallel.tp=2"), "chat", "peft.dropout=0.1 with parallel.tp=2"),
]


@pytest.mark.parametrize("extra,records,said", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_fine_tuning_input_is_one_line_naming_it(toy, extra, records, said):
    from ppsplit.app.checks import validate
    from ppsplit.data.corpus import prepare

    with pytest.raises(PpsplitError) as info:
        spec = _spec(*sft_args(toy, records), *extra)
        checked = validate(spec)
        prepare(spec.data, None, spec.seq_len, spec.seed, checked.config.vocab_size)
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_chat_records_without_a_template_or_an_answer_are_refused(toy, tmp_path):
    from ppsplit.data.corpus import load_tokenizer
    from ppsplit.data.sft import tokenize_examples

    tok = load_tokenizer(toy["tokenizer"])
    spec = _spec(*sft_args(toy)).data
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    with pytest.raises(PpsplitError, match="record 1 of lone.jsonl has no assistant turn"):
        list(tokenize_examples(spec, _records(str(lone)), tok, 128, "lone.jsonl"))
    tok.chat_template = None
    with pytest.raises(PpsplitError, match="has no chat template"):
        list(tokenize_examples(spec, _records(toy["chat"]), tok, 128, "chat.jsonl"))
