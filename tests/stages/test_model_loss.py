"""A module's own loss made of several terms, or a mean over the elements a
boolean mask selects, split by torch.export: each term weighted by its own
count, so the pipe's loss and gradients equal the unsplit module's on
micro-batches that count differently (a question answering model's start
and end losses with positions out of range, BERT's masked LM plus next
sentence losses, ELECTRA's discriminator over the attention mask)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mpstream import Pipe
from tests.helpers import assert_same_grads

VOCAB = 64


class _TwoLosses(nn.Module):
    """A tagger and a classifier: the mean of two cross entropies that
    ignore different tokens and examples, plus their difference scaled (a
    linear combination of its terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.body = nn.Linear(8, 8)
        self.tags = nn.Linear(8, 3)
        self.classes = nn.Linear(8, 2)

    def forward(self, ids: Tensor, tags: Tensor, classes: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.body(self.embed(ids)))
        tagged, classified = self.tags(h), self.classes(h.mean(1))
        a = F.cross_entropy(tagged.view(-1, 3), tags.view(-1))
        b = F.cross_entropy(classified, classes)
        return {"loss": (a + b) / 2 - 0.5 * (b - a), "logits": tagged}


class _MaskedMean(nn.Module):
    """A mean squared error over the tokens a mask selects (as ELECTRA's
    discriminator averages over the attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: Tensor, mask: Tensor, target: Tensor) -> dict[str, Tensor]:
        scores = self.head(torch.tanh(self.embed(ids))).squeeze(-1)
        kept = mask == 1
        return {"loss": F.mse_loss(scores[kept], target[kept]), "scores": scores}


def _check(pipe: Pipe, ref: nn.Module, data: dict[str, Tensor]) -> None:
    """The pipe's loss and gradients, by pipe(**data) and by train_step,
    equal the unsplit module's."""
    out = pipe(**data)
    expected = ref(**data)
    torch.testing.assert_close(out["loss"], expected["loss"])
    out["loss"].backward()
    expected["loss"].backward()
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    for schedule in ["gpipe", "1f1b"]:
        pipe.schedule = schedule
        loss = pipe.train_step(data)
        torch.testing.assert_close(loss, expected["loss"].detach())
        assert_same_grads(pipe, ref)
        pipe.zero_grad()


def _pipe(model: nn.Module, point: str, data: dict[str, Tensor]) -> tuple[Pipe, nn.Module]:
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, split_points=[point], devices=["cpu"] * 2, tracer="export",
                sample=data)  # fmt: skip
    return pipe, ref


def test_each_term_of_a_loss_is_weighted_by_its_own_count() -> None:
    torch.manual_seed(0)
    tags = torch.randint(0, 3, (5, 6))
    tags[0, 1:] = -100  # the first micro-batch holds 7 of the 19 tags counted
    tags[2:4] = -100
    classes = torch.tensor([1, -100, -100, 0, 1])  # and one class of three
    data = {"ids": torch.randint(0, VOCAB, (5, 6)), "tags": tags, "classes": classes}
    pipe, ref = _pipe(_TwoLosses().double(), "tags", data)
    report = pipe.split_report().loss[0]
    assert report.count("by label tokens other than -100") == 2 and "term by term" in report
    _check(pipe, ref, data)


def test_a_mean_over_masked_elements_is_weighted_by_the_mask() -> None:
    torch.manual_seed(0)
    mask = (torch.arange(6) < torch.tensor([6, 1, 2, 6, 3])[:, None]).long()
    data = {
        "ids": torch.randint(0, VOCAB, (5, 6)),
        "mask": mask,
        "target": torch.randn(5, 6, dtype=torch.float64),
    }
    pipe, ref = _pipe(_MaskedMean().double(), "head", data)
    assert "by the elements its mask selects" in pipe.split_report().loss[0]
    _check(pipe, ref, data)


def _transformers() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _encoder(config: str, model: str, **options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = _transformers()
        return getattr(transformers, model)(getattr(transformers, config)(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **options,
        ))  # fmt: skip

    return build


def _hf_batch(name: str) -> dict[str, Tensor]:
    """Five padded sequences; what each model's loss counts differs between
    the micro-batches of 2, 2 and 1."""
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (5, 8))
    mask = (torch.arange(8) < torch.tensor([8, 5, 3, 8, 6])[:, None]).long()
    data = {"input_ids": ids, "attention_mask": mask}
    if name == "question_answering":
        # Positions past the sequence are clamped to it and ignored.
        data["start_positions"] = torch.tensor([1, 9, 0, 2, 3])
        data["end_positions"] = torch.tensor([2, 3, 1, 12, 12])
    elif name == "pretraining":
        labels = ids.masked_fill(torch.rand(5, 8) > 0.3, -100)
        labels[0, :5] = ids[0, :5]
        data["labels"] = labels
        data["next_sentence_label"] = torch.tensor([0, 1, -100, 0, 1])
    else:
        data["labels"] = torch.randint(0, 2, (5, 8))
    return data


HF: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "question_answering": (
        _encoder("BertConfig", "BertForQuestionAnswering"),
        "bert.encoder.layer.0",
    ),
    "pretraining": (_encoder("BertConfig", "BertForPreTraining"), "bert.encoder.layer.0"),
    "electra": (
        _encoder("ElectraConfig", "ElectraForPreTraining", embedding_size=16),
        "electra.encoder.layer.0",
    ),
}


@pytest.mark.parametrize("name", list(HF))
def test_hugging_face_losses_of_several_terms_or_masked(name: str) -> None:
    build, point = HF[name]
    torch.manual_seed(0)
    data = _hf_batch(name)
    pipe, ref = _pipe(build().double(), point, data)
    _check(pipe, ref, data)
