"""Which transformers class a model is, and what it is trained on: the task of its class, read
from the class's name (or from a local folder's ``config.json``). Nothing here imports torch
until a class is looked up."""

from __future__ import annotations

import os

from ppsplit.errors import PpsplitError, nearest

# transformers' class-name endings for each task ("auto" reads the task from them).
TASK_SUFFIXES = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForConditionalGeneration", "seq2seq"),
    ("ForSeq2SeqLM", "seq2seq"),
    ("ForImageClassification", "image_classification"),
)


def task_of(class_name: str) -> str:
    """The task a transformers model class is trained for, from its name's ending."""
    for suffix, task in TASK_SUFFIXES:
        if class_name.endswith(suffix) and len(class_name) > len(suffix):
            return task
    model_class(class_name)  # a name that is not a model class at all is told so, with the nearest
    endings = ", ".join(f"*{suffix}" for suffix, _ in TASK_SUFFIXES)
    raise PpsplitError(f"model.model_class={class_name!r} has no task ppsplit can train; allowed: a "
                       f"transformers class named {endings} (or set model.inputs and model.loss)")


def class_from_pretrained(folder: str) -> str:
    """The model class named by ``architectures`` in ``folder``'s config.json."""
    import json

    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError) as err:
        raise PpsplitError(f"model.pretrained={folder!r}: its config.json cannot be read "
                           f"({type(err).__name__}); give model.model_class") from None
    if not names or not isinstance(names[0], str):
        raise PpsplitError(f"model.pretrained={folder!r}: config.json names no architectures; "
                           "give model.model_class")
    return names[0]


IGNORE = -100  # label value the losses skip, as in transformers


def model_class(name: str):
    """The transformers model class called ``name`` (any with a task ppsplit trains, see
    :data:`TASK_SUFFIXES`)."""
    import transformers

    suffixes = tuple(suffix for suffix, _ in TASK_SUFFIXES)
    cls = getattr(transformers, name, None) if name.isidentifier() and name[0].isupper() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        known = [n for n in dir(transformers) if n.endswith(suffixes)]
        raise PpsplitError(
            f"model.model_class={name!r} is not a transformers model class; allowed: a class named "
            f"{', '.join('*' + s for s in suffixes)}{nearest(name, known)}"
        )
    return cls
