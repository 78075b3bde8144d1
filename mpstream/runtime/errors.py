"""Where a pipeline error happened: stage labels and exception notes.

An exception raised inside a stage reaches the caller unchanged (same object,
type and message); the run loop only adds a note (``BaseException.add_note``,
Python 3.11 and later) naming the stage, its layers and device, the
micro-batch and the task kind, so a shape error in stage 3 of 8 is found at
a glance (:func:`annotate_task`). Stage labels are built once per pipeline;
notes only once something has failed, so the hot path pays nothing.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from types import CodeType, TracebackType
from typing import Any

import torch
from torch import nn

from ..schedules.schedule import Kind, Task
from .microbatch import leaves

__all__ = [
    "layers_label",
    "stage_labels",
    "task_note",
    "input_versions",
    "inplace_hint",
    "dtype_hint",
    "traced_message_hint",
    "annotate",
    "annotate_task",
    "raised_in",
]

# How torch's kernels say two tensors' dtypes differ (CPU and CUDA, linear,
# matmul, norms, RNNs); a convolution's "Input type (X) and weight type (Y)
# should be the same" is matched apart, as it says the same of devices.
_DTYPE_WORDS = re.compile(
    r"same dtype|same datatype|does not match weight dtype|expected scalar type", re.IGNORECASE
)
_CONV_TYPES = re.compile(r"Input type \(([^)]*)\) and \w+ type \(([^)]*)\) should be the same")
# How a torch.fx proxy prints in a message built while tracing.
_PROXY = re.compile(r"\bProxy\(\w+\)")


def layers_label(names: Sequence[str]) -> str:
    """``layer 'fc'``, ``layers '0', '1', '2'`` or ``layers '0' .. '9' (10)``."""
    quoted = [f"'{n}'" for n in names]
    if len(quoted) == 1:
        return f"layer {quoted[0]}"
    if len(quoted) <= 4:
        return "layers " + ", ".join(quoted)
    return f"layers {quoted[0]} .. {quoted[-1]} ({len(quoted)})"


def stage_labels(
    names: Sequence[str], balance: Sequence[int], devices: Sequence[torch.device]
) -> list[str]:
    """One label per stage: ``stage 3 of 8 (layers '6', '7' on cuda:1)``."""
    labels, start = [], 0
    for s, (count, device) in enumerate(zip(balance, devices)):
        group = names[start : start + count]
        labels.append(f"stage {s} of {len(balance)} ({layers_label(group)} on {device})")
        start += count
    return labels


def task_note(task: Task, micros: int, labels: Sequence[str], in_loss: bool = False) -> str:
    """The note for an exception raised while ``task`` ran.

    Args:
        task: the task that was running.
        micros: the number of micro-batches of the run.
        labels: one label per stage (see :func:`stage_labels`).
        in_loss: the exception came from ``loss_fn`` (last stage's forward).
    """
    s, m, kind = task.stage, task.micro, task.kind
    peer = task.peer if task.peer >= 0 else s + 1  # a copy's receiving stage
    mb = f"micro-batch {m} (of {micros})"
    last = len(labels) - 1
    if kind is Kind.FORWARD and in_loss:
        what = f"loss_fn on {mb}, in the forward task of {labels[last]}"
        return f"mpstream: raised by {what}"
    if kind is Kind.FORWARD:
        what = f"the forward task of {labels[s]}, {mb}"
    elif kind is Kind.COPY and s < 0:
        what = f"the transfer of {mb}'s input to {labels[peer]}"
    elif kind is Kind.COPY:
        what = f"the copy of {mb} from {labels[s]} to stage {peer}"
    elif kind is Kind.TARGET:
        what = f"the transfer of {mb}'s target to {labels[last]}"
    elif kind is Kind.BACKWARD:
        what = f"the backward task of {labels[s]}, {mb}"
    elif kind is Kind.WEIGHT:
        what = f"the weight task of {labels[s]}, {mb}"
    else:
        what = f"the copy of {mb}'s gradient from stage {peer} back to {labels[s]}"
    return f"mpstream: raised in {what}"


def input_versions(batches: Sequence[tuple[Any, ...]]) -> list[int]:
    """The version counters of a step's input tensors, before it runs (the
    micro-batches are views of one batch tensor each: they share its
    counter), for :func:`inplace_hint`."""
    if not batches:
        return []
    return [t._version for t in leaves(batches[0])[0] if isinstance(t, torch.Tensor)]


def inplace_hint(
    exc: BaseException, batches: Sequence[tuple[Any, ...]], versions: Sequence[int]
) -> str | None:
    """What to do when a backward finds a saved tensor changed in place
    and a stage changed the step's input in place meanwhile: which differs
    from the whole-batch model, whose input is one tensor. Any stage's
    backward may be the one to find it (the first stage's output is then a
    view of the input, saved by the next stage)."""
    if "modified by an inplace operation" not in str(exc) or versions == input_versions(batches):
        return None
    return (
        "mpstream: a stage changed the pipeline's input in place (a first ReLU(inplace=True), "
        "x.mul_(...)), the likely cause: the micro-batches are views of one batch tensor, "
        "so one micro-batch's change invalidates what autograd saved of another. Make that "
        "operation out-of-place, or pass a copy of the batch"
    )


def dtype_hint(exc: BaseException, task: Task, dtypes: Collection[torch.dtype]) -> str | None:
    """What to do when a stage's kernel finds tensors of two dtypes (a
    float64 batch into a float32 model): the stage's parameter ``dtypes``,
    and the three ways to make them agree."""
    text = str(exc)
    conv = _CONV_TYPES.search(text)
    if conv is not None:
        if _dtype_word(conv.group(1)) == _dtype_word(conv.group(2)):
            return None  # the same dtype on two devices: not this hint's case
    elif not _DTYPE_WORDS.search(text):
        return None
    names = sorted(str(d).removeprefix("torch.") for d in dtypes)
    has = f"parameters of dtype {', '.join(names)}" if names else "no parameters"
    first = sorted(dtypes, key=str)[0] if dtypes else torch.get_default_dtype()
    return (
        f"mpstream: a dtype mismatch in stage {task.stage}, which has {has}: give the pipe "
        f"input of the model's dtype (x.to({first})), convert the model before wrapping it "
        f"(model.to(dtype)), or run the step under torch.autocast to mix precisions"
    )


def traced_message_hint(exc: BaseException) -> str | None:
    """What a traced check's message means: ``torch._assert(h == 32,
    f"... got {h}")`` in a forward ``torch.fx`` traces (torchvision's ViT
    checks the image size so) is recorded with its message already built,
    a proxy's name where the call's value would be."""
    found = _PROXY.search(str(exc))
    if not isinstance(exc, AssertionError) or found is None:
        return None
    return (
        f"mpstream: torch.fx built this message when it traced the forward, so "
        f"'{found.group(0)}' stands where this call's value would be; the check ran on this "
        f"call's values (the plain model, called on the same input, shows them)"
    )


def _dtype_word(name: str) -> str:
    """``torch.cuda.FloatTensor`` and ``float`` alike: ``float``."""
    word = name.rsplit(".", 1)[-1].removesuffix("Tensor").lower()
    return {"float32": "float", "float64": "double", "float16": "half"}.get(word, word)


def raised_in(exc: BaseException, code: CodeType) -> bool:
    """Whether ``exc``'s traceback passes through a frame running ``code``."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def annotate(exc: BaseException, note: str) -> None:
    """Adds ``note`` to ``exc`` where Python supports notes (3.11+)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)


def annotate_task(
    exc: BaseException,
    task: Task | None,
    micros: int,
    labels: Sequence[str],
    partitions: Sequence[nn.Module],
    loss: CodeType | None = None,
) -> None:
    """Notes on ``exc`` which task of a run raised it, and a hint where one
    applies (a dtype mismatch in a stage, a message torch.fx built while
    tracing).

    Args:
        exc: what the run raised.
        task: the task that was running (None: none was; no note).
        micros: the number of micro-batches of the run.
        labels: one label per stage (see :func:`stage_labels`).
        partitions: the stages' modules (their parameters' dtypes).
        loss: the code of the loss computation, to tell ``loss_fn``'s errors
            from the last stage's (None: the run has no loss).
    """
    # Only errors: an interrupt is not the task's fault.
    if task is not None and isinstance(exc, Exception):
        in_loss = loss is not None and task.kind is Kind.FORWARD and raised_in(exc, loss)
        annotate(exc, task_note(task, micros, labels, in_loss))
        hint = None
        if 0 <= task.stage < len(partitions):
            params = partitions[task.stage].parameters()
            hint = dtype_hint(exc, task, {p.dtype for p in params})
        if hint is None:
            hint = traced_message_hint(exc)
        if hint is not None:
            annotate(exc, hint)
