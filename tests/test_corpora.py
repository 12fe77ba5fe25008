"""Corpora of any size: read as a stream, tokenized in processes into a token store that
ranks memory-map, long documents cut into pieces, many files, an interrupted preparation
leaving nothing behind, and the stream's order drawn without holding the corpus."""

import glob
import json
import os
import signal
import time

import numpy as np
import pytest

from conftest import ForkedCli, run_cli
from helpers import compose_cfg
from test_reliability import alive


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from ppsplit.data.toy_corpus import make

    folder = tmp_path_factory.mktemp("corpora")
    corpus, tokenizer = make(str(folder), kb=60, vocab=500)
    return {"folder": folder, "txt": corpus, "tokenizer": tokenizer}


def data_spec(toy, path, cache, *overrides):
    from ppsplit.config.spec import from_config

    return from_config(compose_cfg("data=text", f"data.path={path}", f"data.tokenizer={toy['tokenizer']}",
                                   f"data.cache_dir={cache}", "model.config.vocab_size=500", *overrides)).data


def prepare(spec, seq_len=32, seed=0):
    from ppsplit.data.corpus import prepare as prepare_store

    return prepare_store(spec, None, seq_len, seed, 500, progress=False)


def store(path):
    from ppsplit.data.store import open_store

    return open_store(path)[0]


def test_processes_pack_what_one_process_packs_and_ranks_map_it(toy, tmp_path, monkeypatch):
    import ppsplit.data.pack as pack
    from ppsplit.data.corpus import TokenBlocks, load_tokenizer, separator_of

    monkeypatch.setattr(pack, "BATCH_CHARS", 4096)  # about fifteen batches: the pool takes them
    one = prepare(data_spec(toy, toy["txt"], tmp_path / "one", "data.num_proc=1"))
    two = prepare(data_spec(toy, toy["txt"], tmp_path / "two", "data.num_proc=2"))
    a, b = store(one), store(two)
    assert len(a["train"]) > 10 and np.array_equal(a["train"], b["train"]) and np.array_equal(a["val"], b["val"])
    tokenizer = load_tokenizer(toy["tokenizer"])
    docs = [d for d in open(toy["txt"]).read().split("\n\n") if d.strip()]
    expected = tokenizer(docs[0], add_special_tokens=False)["input_ids"] + [separator_of(tokenizer)]
    held = a["val"].reshape(-1)  # document 0 is always held out: it opens the held-out side
    assert held[:len(expected)].tolist() == expected[:len(held)]
    blocks = TokenBlocks(two, seed=0)
    assert isinstance(blocks.train, np.memmap) and blocks.train.dtype == np.uint16  # 500 ids fit in two bytes
    assert [p for p in os.listdir(tmp_path / "two") if ".partial-" in p] == []


def test_a_failed_preparation_leaves_no_store_and_the_next_one_is_whole(toy, tmp_path, monkeypatch):
    import ppsplit.data.pack as pack

    real, calls = pack._encode, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as Ctrl-C would, in the middle
        return real(*args)

    monkeypatch.setattr(pack, "BATCH_CHARS", 4096)
    monkeypatch.setattr(pack, "_encode", failing)
    spec = data_spec(toy, toy["txt"], tmp_path, "data.num_proc=1")
    with pytest.raises(KeyboardInterrupt):
        prepare(spec)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(pack, "_encode", real)
    assert np.array_equal(store(prepare(spec))["train"], store(prepare(data_spec(toy, toy["txt"], tmp_path / "b")))["train"])


def test_a_long_document_is_cut_into_pieces_and_a_file_without_blank_lines_trains(toy, tmp_path):
    from ppsplit.data.read import PIECE, pieces

    words = open(toy["txt"]).read().split()
    line = " ".join(words * (1 + 5 * PIECE // len(" ".join(words))))[:int(2.5 * PIECE)]
    cut = list(pieces(line))
    assert len(cut) == 3 and max(map(len, cut)) <= PIECE and "".join(cut) == line
    (tmp_path / "one_line.txt").write_text(line)  # no blank line: one paragraph of 2.5 million characters
    proc = run_cli("data=text", f"data.path={tmp_path / 'one_line.txt'}", f"data.tokenizer={toy['tokenizer']}",
                   f"data.cache_dir={tmp_path / 'cache'}", "model.config.vocab_size=500", "data.num_proc=2",
                   "launcher=inline", "steps=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "run" / "report.json").read_text())["data"]
    assert data["documents"] == 3 and data["val_documents"] >= 1 and data["train_blocks"] > 0


def test_thousands_of_files_under_a_glob_pack_as_their_concatenation(toy, tmp_path):
    docs = [d.strip() for d in open(toy["txt"]).read().split("\n\n") if d.strip()]
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(1000):  # a document or two a file, in name order
        (folder / f"part-{i:05d}.txt").write_text("\n\n".join(docs[2 * i % len(docs):2 * i % len(docs) + 1 + i % 2]))
    joined = "\n\n".join((folder / f"part-{i:05d}.txt").read_text() for i in range(1000))
    (tmp_path / "all.txt").write_text(joined)
    many = prepare(data_spec(toy, f"{folder}/*.txt", tmp_path / "cache"))
    one = prepare(data_spec(toy, tmp_path / "all.txt", tmp_path / "cache"))
    assert many != one and np.array_equal(store(many)["train"], store(one)["train"])
    meta = json.loads(open(os.path.join(many, "meta.json")).read())
    assert meta["documents"] > 1000 and len(meta["files"]) == 101  # the first hundred named, and the count


def test_a_jsonl_field_missing_from_the_first_record_is_named_after_blank_lines(tmp_path):
    from ppsplit import PpsplitError
    from ppsplit.data.read import _jsonl

    path = tmp_path / "lead.jsonl"
    path.write_text("\n  \n" + json.dumps({"body": "a document"}) + "\n")
    with pytest.raises(PpsplitError, match="data.field='text' is not in lead.jsonl's records; allowed: body"):
        list(_jsonl(str(path), "text", lambda n: None))
    assert list(_jsonl(str(path), "body", lambda n: None)) == ["a document"]


def test_each_epoch_reads_every_block_once_in_an_order_of_its_own():
    from ppsplit.data.order import BlockOrder, held_out

    for n in (1, 2, 7, 1000, 4097):
        order = BlockOrder(n, seed=3)
        epochs = [order.blocks(np.arange(e * n, (e + 1) * n)) for e in range(2)]
        assert all(sorted(e.tolist()) == list(range(n)) for e in epochs)
        assert np.array_equal(BlockOrder(n, seed=3).blocks(np.arange(n)), epochs[0])
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], np.arange(n))
    assert not np.array_equal(BlockOrder(n, seed=4).blocks(np.arange(n)), epochs[0])
    drawn = held_out(0, 20_000, seed=0, fraction=0.05)
    assert drawn[0] and drawn.sum() == 1000 and drawn.reshape(-1, 20).sum(1).tolist() == [1] * 1000
    assert [held_out(0, 160, 0, f).sum() for f in (0.1, 0.3, 0.9)] == [16, 48, 144]  # f of them, every 20
    assert np.array_equal(np.concatenate([held_out(0, 7000, 0, 0.05), held_out(7000, 13_000, 0, 0.05)]), drawn)
    assert not held_out(0, 100, 0, 0.0).any()


@pytest.mark.slow
def test_a_stop_while_tokenizing_leaves_no_store_and_no_process(toy, tmp_path):
    text = open(toy["txt"]).read()
    with open(tmp_path / "big.txt", "w") as f:
        for _ in range(500):  # 30 MB: several seconds of tokenizing
            f.write(text + "\n\n")
    cache = tmp_path / "cache"
    proc = ForkedCli(["data=text", f"data.path={tmp_path / 'big.txt'}", f"data.tokenizer={toy['tokenizer']}",
                      f"data.cache_dir={cache}", "model.config.vocab_size=500", "data.num_proc=2",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    end, workers = time.monotonic() + 120, []
    while time.monotonic() < end and not workers:
        workers = _children(proc.pid) if glob.glob(f"{cache}/packed-*.partial-*") else []
        time.sleep(0.1)
    assert workers, proc.stderr()[-2000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert proc.stderr().strip().splitlines()[-1].startswith("ppsplit: ")
    assert os.listdir(cache) == []
    time.sleep(0.5)
    assert [pid for pid in workers if alive(pid)] == []


def _children(pid: int) -> list[int]:
    out = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        out += [int(p) for p in open(task).read().split()]
    return out


def test_chat_records_stream_into_mapped_rows_packed_full(tmp_path):
    from ppsplit.config.spec import from_config
    from ppsplit.data.corpus import TokenBlocks, load_tokenizer, prepare as prepare_store
    from ppsplit.data.toy_corpus import make

    _, tokenizer = make(str(tmp_path / "toy"), kb=20, vocab=500, chat=200)
    spec = from_config(compose_cfg("model=llama", "data=sft", f"data.path={tmp_path / 'toy' / 'chat.jsonl'}",
                                   f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path / 'cache'}",
                                   "data.truncate=true", "seq_len=128", "model.config.vocab_size=500"))
    blocks = TokenBlocks(prepare_store(spec.data, None, 128, 0, 500, progress=False), seed=0)
    assert isinstance(blocks.arrays["train_labels"], np.memmap) and blocks.meta["documents"] == 200
    assert blocks.meta["val_documents"] == 10  # 0.05 of them, one in every 20
    pad = load_tokenizer(tokenizer).pad_token_id
    starts = (np.asarray(blocks.arrays["train_positions"]) == 0) & (np.asarray(blocks.train) != pad)
    assert starts.sum() == 190  # each training example in a row, once (the padding is no example)


def test_chat_records_tokenize_in_processes_as_in_one_and_a_worker_refusal_is_one_line(tmp_path, monkeypatch):
    import ppsplit.data.sft as sft
    from ppsplit import PpsplitError
    from ppsplit.config.spec import from_config
    from ppsplit.data.corpus import prepare as prepare_store
    from ppsplit.data.store import open_store
    from ppsplit.data.toy_corpus import make

    monkeypatch.setattr(sft, "RECORDS", 16)  # thirteen tasks: the pool takes them
    _, tokenizer = make(str(tmp_path / "toy"), kb=20, vocab=500, chat=200)

    def spec(procs, *extra):
        return from_config(compose_cfg("model=llama", "data=sft", f"data.path={tmp_path / 'toy' / 'chat.jsonl'}",
                                       f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path / str(procs)}",
                                       f"data.num_proc={procs}", "model.config.vocab_size=500", *extra)).data

    paths = [prepare_store(spec(n, "data.truncate=true"), None, 128, 0, 500, progress=False) for n in (1, 2)]
    (one, one_meta), (two, two_meta) = (open_store(p) for p in paths)
    assert one_meta["num_proc"] == 1 and two_meta["num_proc"] == 2 and one_meta["documents"] == 200
    assert one.keys() == two.keys() and all(np.array_equal(one[k], two[k]) for k in one)
    with pytest.raises(PpsplitError, match="data.truncate=false: record 1 of chat.jsonl is") as info:
        prepare_store(spec(2), None, 16, 0, 500, progress=False)
    assert "\n" not in str(info.value) and os.listdir(tmp_path / "2") == [os.path.basename(paths[1])]


def test_rows_are_packed_best_fit_as_the_examples_come_nearly_as_full_as_can_be():
    from ppsplit.data.sft import RowPacker

    lengths = np.random.default_rng(0).integers(5, 128, 2000)
    packer, rows = RowPacker(128, pad=0, packing=True), []
    for n in lengths:
        rows += packer.add(np.full(n, 7, dtype=np.int32), np.ones(n, dtype=bool))
    rows += packer.finish()
    assert sum(int((r["ids"] == 7).sum()) for r in rows) == lengths.sum()  # every token once
    assert len(rows) <= 1.03 * np.ceil(lengths.sum() / 128)  # within 3% of rows filled to the last token
