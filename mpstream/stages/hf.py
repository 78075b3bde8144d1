"""Hugging Face transformers models: their calling convention in a Pipe.

A ``transformers`` model is called with keyword arguments (``input_ids=``,
``attention_mask=``, ``labels=``) and returns a ``ModelOutput`` whose
``loss`` it computed itself. mpstream splits such a model with
``torch.export`` (:mod:`~mpstream.stages.exported`), which takes the same calls
and returns the same structure, with the loss weighted over micro-batches
(:mod:`~mpstream.stages.model_loss`). This module adds what is particular to the
library: a pipeline runs training and scoring passes, so the key/value cache
is turned off (``use_cache=False`` unless the caller says otherwise, which
is refused); a caller's ``num_items_in_batch`` (the Hugging Face Trainer's
normaliser, a scalar every micro-batch gets whole; a whole number becomes
an int64 tensor, so that its value is no part of the call's kind) already makes each
micro-batch's loss a share of the batch's;
``return_dict=False`` is refused (the loss is found by name), and so is a
mixture of experts' ``output_router_logits=True`` (its load-balancing loss
is over the whole batch); and without a
``sample=``, the model's ``dummy_inputs`` are its example call.

``transformers`` itself is not imported: a model is recognised by its
classes.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import torch
from torch import Tensor, nn

from ..runtime.microbatch import NoChunk

__all__ = ["is_transformers_model", "Calls", "HuggingFaceCalls", "calls_for"]


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


class Calls:
    """How a module split by ``torch.export`` is called: as written.

    Subclasses adapt a family's convention (see :class:`HuggingFaceCalls`).
    """

    family = ""

    def prepare(self, named: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments by name, as the module is to be called."""
        return named

    def weighs_loss(self, named: dict[str, Any]) -> bool:
        """Whether the pipeline weights a ``loss`` output per micro-batch
        (False when the call makes each micro-batch's loss a share already)."""
        return True

    def sample(self, module: nn.Module) -> dict[str, Any] | None:
        """An example call to export when the caller gave none."""
        return None

    def export_advice(self, where: str) -> str:
        """What to do about data-dependent code in submodule ``where`` (or
        ``'name'``) that ``torch.export`` could not export."""
        return (
            f"mark the submodule holding it as a leaf for torch.fx (Pipe(..., tracer='fx', "
            f"leaf_modules=['{where}']): it then runs whole inside one stage)"
        )


class HuggingFaceCalls(Calls):
    """The calling convention of ``transformers`` models.

    Args:
        model: the ``PreTrainedModel``.
    """

    family = "Hugging Face transformers"

    def __init__(self, model: nn.Module) -> None:
        self.name = type(model).__name__
        self.takes = set(inspect.signature(model.forward).parameters)
        self.config = getattr(model, "config", None)

    def prepare(self, named: dict[str, Any]) -> dict[str, Any]:
        """Turns caching off; refuses a cache, tuple outputs and a router's loss.

        Raises:
            ValueError: ``use_cache=True``, a cache (``past_key_values``,
                ``cache``), ``return_dict=False`` or a mixture of experts'
                ``output_router_logits=True`` (given, or the config's) given.
        """
        given = next((k for k in ("past_key_values", "cache") if named.get(k) is not None), None)
        if given is not None:
            raise ValueError(
                f"{self.name} was given {given}: a pipeline splits the batch into "
                f"micro-batches and runs training and scoring passes; generate with the unsplit "
                f"model (incremental decoding does not pipeline)"
            )
        if named.get("use_cache"):
            raise ValueError(
                f"{self.name} was called with use_cache=True: a pipeline keeps no key/value "
                f"cache (each micro-batch would need its own); leave use_cache unset (the pipe "
                f"passes use_cache=False) and generate with the unsplit model"
            )
        router = named.get("output_router_logits")
        if router is None:  # the model then reads its config's
            router = getattr(self.config, "output_router_logits", False)
        if router:
            # The load-balancing loss multiplies the batch's routing fractions
            # over all its tokens: the micro-batches' terms do not add up to it.
            raise ValueError(
                f"{self.name} computes its router's load-balancing loss (aux_loss) with "
                f"output_router_logits=True: that loss is over the whole batch's routing and "
                f"does not split into micro-batches, so the pipe could not equal the unsplit "
                f"model; pass output_router_logits=False (or set "
                f"config.output_router_logits=False): the loss is then the model's loss "
                f"without that term"
            )
        if named.get("return_dict") is False:
            raise ValueError(
                f"{self.name} was called with return_dict=False: the pipe finds the model's "
                f"loss by name in its ModelOutput; leave return_dict unset"
            )
        if "use_cache" in self.takes and "use_cache" not in named:
            named = {**named, "use_cache": False}
        count = named.get("num_items_in_batch")
        number = _whole_number(count)
        if number is not None:
            # A plain number is fixed by the export: each step's count would
            # export again. A tensor is an input, whatever its value; an int64
            # one divides a loss of any float dtype into that dtype, as the
            # number did (a float64 one would make a float32 loss float64).
            count = torch.tensor(number)
        if isinstance(count, Tensor) and count.dim() == 0:
            # The batch's count, the same for every micro-batch.
            named = {**named, "num_items_in_batch": NoChunk(count)}
        return named

    def weighs_loss(self, named: dict[str, Any]) -> bool:
        # With num_items_in_batch the model divides each micro-batch's summed
        # loss by the batch's count: the shares add up already.
        return named.get("num_items_in_batch") is None

    def sample(self, module: nn.Module) -> dict[str, Any] | None:
        dummy = getattr(module, "dummy_inputs", None)
        return dict(dummy) if isinstance(dummy, dict) else None

    def export_advice(self, where: str) -> str:
        # torch.fx traces no transformers model (its forward branches on its
        # inputs, masks and caches; the decorated forward takes **kwargs), so
        # a leaf for torch.fx is no way out: the model's own tensor-only
        # implementation is. A mixture-of-experts block's "eager" experts
        # loop over the experts a batch routes to; "grouped_mm" does not.
        return (
            f"pick the model's implementation of '{where}' that uses tensor operations "
            f"only where its config offers one (a mixture-of-experts block: "
            f"experts_implementation='grouped_mm', the default, instead of 'eager'); "
            f"torch.fx does not trace {self.name}, so a leaf for it does not help"
        )


def _whole_number(value: Any) -> int | None:
    """``value`` as an int if it is a count given as a plain number (numpy's
    too): an integer, or a float holding one; not a bool. Else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(float(value))
    return None


def calls_for(module: nn.Module) -> Calls:
    """The calling convention of ``module``'s family."""
    return HuggingFaceCalls(module) if is_transformers_model(module) else Calls()
