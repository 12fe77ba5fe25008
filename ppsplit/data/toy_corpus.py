"""A corpus and a tokenizer to try ``data=text`` with, made here, with nothing downloaded:

    python -m ppsplit.data.toy_corpus DIR [--kb 300] [--vocab 1000] [--chat 0]

writes ``DIR/corpus.txt`` (the docstrings of Python's own standard library, one paragraph per
document, about ``--kb`` kilobytes) and ``DIR/tokenizer/`` (a byte-level BPE of ``--vocab``
tokens trained on it with the ``tokenizers`` library, saved as a transformers tokenizer folder
with EOS, UNK, PAD and MASK tokens, so causal, masked and encoder-decoder models can all use it,
and a small chat template). With ``--chat N``, also ``DIR/chat.jsonl`` (N conversations: a
system line, a user asking to repeat a phrase of the corpus backwards, the assistant's answer)
and ``DIR/prompts.jsonl`` (the same as prompt/completion records), to try ``data=sft`` with.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import sys
import warnings

# Modules whose import has side effects (a window, a browser, the interpreter's exit) or is slow.
_SKIP = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "pydoc_data",
         "ensurepip", "venv", "webbrowser", "__main__", "msilib", "winreg", "winsound")


def docstrings(limit_bytes: int) -> list[str]:
    """Paragraphs of the standard library's docstrings, in a fixed order, up to ``limit_bytes``."""
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names
                   and not m.name.startswith("_") and m.name not in _SKIP)
    paragraphs, seen, size = [], set(), 0
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # a platform module this machine lacks
                continue
        for obj in [module, *(v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v))]:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) > 40 and para not in seen:
                    seen.add(para)
                    paragraphs.append(para)
                    size += len(para) + 2
                    if size >= limit_bytes:
                        return paragraphs
    return paragraphs


# A chat template of the usual shape (a header per turn, an end token after each), without
# {% generation %} markers, as most shipped templates are.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_records(paragraphs: list[str], count: int) -> tuple[list[dict], list[dict]]:
    """``count`` conversations and as many prompt/completion records: reverse a short phrase."""
    phrases = [" ".join(p.split()[i:i + 4]) for p in paragraphs for i in range(0, 12, 4) if len(p.split()) >= i + 4]
    chats, prompts = [], []
    for phrase in phrases[:count]:
        answer = " ".join(reversed(phrase.split()))
        chats.append({"messages": [{"role": "system", "content": "You answer briefly."},
                                   {"role": "user", "content": f"Reverse: {phrase}"},
                                   {"role": "assistant", "content": answer}]})
        prompts.append({"prompt": f"Reverse: {phrase}\nAnswer:", "completion": f" {answer}"})
    return chats, prompts


def make(folder: str, kb: int = 300, vocab: int = 1000, chat: int = 0) -> tuple[str, str]:
    """Write the corpus and the tokenizer under ``folder`` (and ``chat`` chat and prompt records);
    returns the corpus's and the tokenizer's paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(folder, exist_ok=True)
    corpus = os.path.join(folder, "corpus.txt")
    paragraphs = docstrings(kb * 1024)
    with open(corpus, "w") as f:
        f.write("\n\n".join(paragraphs) + "\n")
    specials = ["<eos>", "<unk>", "<pad>", "<mask>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([corpus], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>")
    fast.chat_template = CHAT_TEMPLATE
    path = os.path.join(folder, "tokenizer")
    fast.save_pretrained(path)
    if chat:
        import json

        chats, prompts = chat_records(paragraphs, chat)
        for name, records in (("chat.jsonl", chats), ("prompts.jsonl", prompts)):
            with open(os.path.join(folder, name), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    return corpus, path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ppsplit.data.toy_corpus", description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--kb", type=int, default=300, help="the corpus's size in kilobytes (default 300)")
    parser.add_argument("--vocab", type=int, default=1000, help="the tokenizer's vocabulary (default 1000)")
    parser.add_argument("--chat", type=int, default=0, help="also this many chat and prompt records (default 0)")
    args = parser.parse_args(argv)
    corpus, tokenizer = make(args.folder, args.kb, args.vocab, args.chat)
    print(f"corpus: {corpus} ({os.path.getsize(corpus) / 1024:.0f} KB); tokenizer: {tokenizer}"
          + (f"; chat: {os.path.join(args.folder, 'chat.jsonl')}, {os.path.join(args.folder, 'prompts.jsonl')}"
             if args.chat else ""))


if __name__ == "__main__":
    main()
