"""Hugging Face families beyond tests/stages/test_hf.py's four, each from a
tiny config in float64 and split at a block: Mistral, Qwen2, Qwen3, Phi, Phi-3,
Gemma, Gemma 2, GPT-NeoX, OPT, Falcon, BLOOM, GPT-J, a Mixtral MoE, BART,
RoBERTa, DistilBERT, ELECTRA, BERT with token_type_ids and ViT equal the
unsplit model (outputs, the model's own loss, every gradient) on padded
batches that the micro-batches do not divide, on two schedules with
checkpointing; the calls their users make (hidden states, position ids,
``return_dict=True``) too; two decoders and an encoder, in four stages, on
interleaved 1F1B, interleaved zero-bubble and ZB-H1 as well. A model
torch.export cannot take (an MoE's "eager" experts) is refused with advice
that works for a transformers model, and so is an MoE's load-balancing loss
(``output_router_logits``), which is over the whole batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe

from .test_hf import VOCAB, assert_same_grads, batch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# One layer, split before it: what crosses the split (hidden states,
# position embeddings, the mask) is what crosses between two layers, and
# each layer exported costs time. Gemma 2 keeps two: its layers alternate
# sliding and full attention. Gemma's and Qwen3's head_dim is set apart.
DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, num_hidden_layers=1,
)  # fmt: skip
ENCODER = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip


def _model(config: str, model: str, **options: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**options))


# name: (builds the model, its split point, float64 or not)
# fmt: off
FAMILIES: dict[str, tuple[Callable[[], nn.Module], str, bool]] = {
    "mistral": (_model("MistralConfig", "MistralForCausalLM", **DECODER), "model.layers.0", True),
    "qwen2": (_model("Qwen2Config", "Qwen2ForCausalLM", **DECODER), "model.layers.0", True),
    "qwen3": (
        _model("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **DECODER), "model.layers.0", True
    ),
    "phi": (
        _model("PhiConfig", "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, **DECODER),
        "model.layers.0", True,
    ),
    "phi3": (
        _model("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **DECODER), "model.layers.0", True
    ),
    "gemma": (
        _model("GemmaConfig", "GemmaForCausalLM", head_dim=8, **DECODER), "model.layers.0", True
    ),
    "gemma2": (
        _model(
            "Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=16,
            **{**DECODER, "num_hidden_layers": 2},
        ),
        "model.layers.1", True,
    ),
    "gpt_neox": (
        _model(
            "GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32,
            intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
            max_position_embeddings=32,
        ),
        "gpt_neox.layers.0", True,
    ),
    "opt": (
        _model(
            "OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
            num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=32,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
        ),
        "model.decoder.layers.0", True,
    ),
    "falcon": (
        _model(
            "FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32,
            num_attention_heads=4, num_hidden_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
        ),
        "transformer.h.0", True,
    ),
    "bloom": (
        _model("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32, n_head=4,
               n_layer=1),
        "transformer.h.0", True,
    ),
    "gptj": (
        _model(
            "GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=1,
            n_positions=32, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
        "transformer.h.0", True,
    ),
    # grouped_mm (the default experts) takes no float64.
    "mixtral": (
        _model("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
               output_router_logits=True, **DECODER),
        "model.layers.0", False,
    ),
    "bart": (
        _model(
            "BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=32,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
            decoder_start_token_id=2, bos_token_id=1, eos_token_id=2,
        ),
        "model.decoder", True,
    ),
    "roberta": (
        _model("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1, **ENCODER),
        "roberta.encoder.layer.0", True,
    ),
    "distilbert": (
        _model(
            "DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=32, n_layers=1,
            n_heads=4, hidden_dim=64, max_position_embeddings=32, dropout=0.0,
            attention_dropout=0.0,
        ),
        "distilbert.transformer.layer.0", True,
    ),
    "electra": (
        _model("ElectraConfig", "ElectraForMaskedLM", embedding_size=16, **ENCODER),
        "electra.encoder.layer.0", True,
    ),
    "bert_classifier": (
        _model("BertConfig", "BertForSequenceClassification", num_labels=3, **ENCODER),
        "bert.encoder.layer.0", True,
    ),
    "vit": (
        _model(
            "ViTConfig", "ViTForImageClassification", image_size=16, patch_size=4,
            num_channels=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=3,
        ),
        "vit.layers.0", True,
    ),
}
# fmt: on


def family_batch(name: str) -> dict[str, Tensor]:
    """Five examples as the family's users give them: padded token ids and
    labels (-100 on padding), a class per example with token_type_ids for a
    classifier, or images."""
    torch.manual_seed(1)
    if name == "vit":
        return {
            "pixel_values": torch.randn(5, 3, 16, 16, dtype=torch.float64),
            "labels": torch.randint(0, 3, (5,)),
        }
    data = batch()
    if name == "bert_classifier":
        data["labels"] = torch.randint(0, 3, (5,))
        data["token_type_ids"] = (torch.arange(8) >= 4).long().expand(5, -1).clone()
    return data


# The calls users make, each on one family (one export for all of a call's
# arguments): hidden states, position ids and return_dict on Qwen2; an MoE's
# router loss turned off on Mixtral (its config asks for it).
CALLS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "output_hidden_states": True,
        "position_ids": torch.arange(8).expand(5, -1).clone(),
        "return_dict": True,
    },
    "mixtral": {"output_router_logits": False},
}


# Two decoders and an encoder in four stages (one more split on each side
# of the block: embeddings, the block, the final norm or pooler, the head),
# so that two CPU ranks hold two each for the interleaved schedules, and
# ZB-H1 runs four ranks; the same export trains on every schedule.
FOUR_STAGES = {
    "mistral": ["model.layers.0", "model.norm", "lm_head"],
    "gemma2": ["model.layers.1", "model.norm", "lm_head"],
    "bert_classifier": ["bert.encoder.layer.0", "bert.pooler", "classifier"],
}
# (schedule, checkpoint, virtual_stages)
SCHEDULES: list[tuple[str, str, int | None]] = [
    ("gpipe", "never", None),
    ("1f1b", "except_last", None),
]
MORE_STAGES = [
    ("interleaved_1f1b", "never", 2),
    ("interleaved_zb", "never", 2),
    ("zb_h1", "never", None),
]


def pipe_and_reference(name: str) -> tuple[Pipe, nn.Module, dict[str, Any]]:
    """The family's pipe, exported for its batch and call."""
    build, point, float64 = FAMILIES[name]
    points = FOUR_STAGES.get(name, [point])
    torch.manual_seed(0)
    model = build().double() if float64 else build()
    ref = copy.deepcopy(model)
    data = family_batch(name)
    if not float64:
        data = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    data = {**data, **CALLS.get(name, {})}
    pipe = Pipe(model, chunks=3, split_points=points, devices=["cpu"] * (len(points) + 1),
                sample=data)  # fmt: skip
    return pipe, ref, data


def reference(ref: nn.Module, data: dict[str, Any]) -> Any:
    """The unsplit model's output for the pipe's call: no cache, as the pipe."""
    takes_cache = "use_cache" in _takes(ref) and "use_cache" not in data
    return ref(**data, use_cache=False) if takes_cache else ref(**data)


def _takes(model: nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def assert_same_outputs(out: Any, expected: Any) -> None:
    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys())
    for key in out.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_equals_the_unsplit_model(name: str) -> None:
    pipe, ref, data = pipe_and_reference(name)
    # 5 examples in micro-batches of 2, 2, 1.
    out = pipe(**data)
    expected = reference(ref, data)
    assert_same_outputs(out, expected)
    if data.get("output_hidden_states"):
        assert len(out.hidden_states) == 2
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    ref.zero_grad()
    for schedule, checkpoint, virtual in SCHEDULES + (MORE_STAGES if name in FOUR_STAGES else []):
        pipe.schedule, pipe.checkpoint, pipe.virtual_stages = schedule, checkpoint, virtual
        loss = pipe.train_step(data)
        expected_loss = reference(ref, data).loss
        expected_loss.backward()
        torch.testing.assert_close(loss, expected_loss.detach())
        assert_same_grads(pipe, ref)
        pipe.zero_grad()
        ref.zero_grad()
    if name == "qwen2":
        with pytest.raises(ValueError, match="return_dict=False"):
            pipe(**{**data, "return_dict": False})
    if name == "mixtral":
        # The router's load-balancing loss is over the whole batch: refused
        # whether the config (the call leaving it out) or the call asks.
        for refused in [{**data, "output_router_logits": True}, family_batch(name)]:
            with pytest.raises(ValueError, match="output_router_logits=True"):
                pipe(**refused)


def test_eager_experts_are_refused_with_advice_for_a_transformers_model() -> None:
    config = transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **DECODER
    )
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(TypeError) as info:
        Pipe(model, chunks=2, split_points=["model.layers.0"], devices=["cpu"] * 2,
             sample=batch())  # fmt: skip
    message = str(info.value)
    assert "inside submodule 'model.layers.0.mlp.experts'" in message
    assert "experts_implementation='grouped_mm'" in message
    # torch.fx traces no transformers model: no advice to use it.
    assert "tracer='fx'" not in message


def test_a_router_load_balancing_loss_is_refused_before_export() -> None:
    # The config's True, with a sample leaving it out: refused before anything
    # is exported (test_family_equals_the_unsplit_model[mixtral] trains the
    # same model with the call's False, and is refused the call's True).
    model = FAMILIES["mixtral"][0]()
    with pytest.raises(ValueError, match=r"aux_loss.*pass output_router_logits=False"):
        Pipe(model, chunks=3, split_points=["model.layers.0"], devices=["cpu"] * 2,
             sample=batch())  # fmt: skip
