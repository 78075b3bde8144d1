"""Hugging Face transformers models pipelined through their own calling
convention (keyword arguments, ModelOutput, the model's own loss): GPT-2,
BERT, Llama and T5 from tiny configs equal the unsplit model (loss and every
gradient) at several split points and chunk counts, on every schedule and
checkpoint mode, with micro-batches of unequal size and label counts."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mpstream import Pipe
from mpstream.stages.exported import ExportSplit

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 100


def gpt2(dropout: float = 0.0) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config)


def llama(layers: int = 3) -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64,
        vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def make(build: Any, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A float64 model and its unsplit reference copy."""
    torch.manual_seed(seed)
    model = build().double()
    return model, copy.deepcopy(model)


def batch(size: int = 5, length: int = 8, *, labels: bool = True) -> dict[str, Tensor]:
    """Right-padded sequences of different lengths; the labels of padding
    are -100, and the last example has none at all."""
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (size, length))
    lengths = torch.tensor([length, 5, 3, length, 6, 2, 7, 4][:size])
    mask = (torch.arange(length) < lengths[:, None]).long()
    out = {"input_ids": ids, "attention_mask": mask}
    if labels:
        target = ids.masked_fill(mask == 0, -100)
        target[-1] = -100
        out["labels"] = target
    return out


def check_loss(pipe: Pipe, ref: nn.Module, data: dict[str, Tensor], **tol: Any) -> None:
    """pipe(**data): every output and, through its loss, every gradient."""
    out = pipe(**data)
    expected = ref(**data, use_cache=False) if "use_cache" in _takes(ref) else ref(**data)
    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys())
    for key in out.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key, **tol)
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    ref.zero_grad()


def check_train_step(pipe: Pipe, ref: nn.Module, data: dict[str, Tensor]) -> None:
    loss = pipe.train_step(data)  # the model's own loss
    expected = ref(**data).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    ref.zero_grad()


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """Every parameter gradient of ``a`` equals ``b``'s (both None where the
    loss does not reach a parameter)."""
    pa, pb = list(a.named_parameters()), list(b.named_parameters())
    assert [n for n, _ in pa] == [n for n, _ in pb]
    for (name, x), (_, y) in zip(pa, pb):
        if y.grad is None:
            assert x.grad is None, f"a gradient for {name}"
        else:
            assert x.grad is not None, f"no gradient for {name}"
            torch.testing.assert_close(x.grad, y.grad, msg=f"gradient of {name}")


def _takes(model: nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def test_gpt2_its_tied_embedding_and_every_schedule() -> None:
    model, ref = make(gpt2)
    data = batch()
    pipe = Pipe(model, chunks=3, split_points=["transformer.h.1"], devices=["cpu"] * 2,
                sample=data)  # fmt: skip
    report = pipe.split_report()
    assert report.tracer == "torch.export" and "Hugging Face" in report.reason
    assert "label tokens other than -100" in report.loss[0]
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert list(pipe.state_dict()) == list(ref.state_dict())
    # 5 examples in micro-batches of 2, 2, 1; the last holds no label at all.
    check_loss(pipe, ref, data)
    for schedule in ["gpipe", "1f1b", "zb_h1"]:
        pipe.schedule = schedule
        check_train_step(pipe, ref, data)
    # What a pipeline cannot do is refused before anything runs.
    with pytest.raises(ValueError, match="use_cache=True"):
        pipe(**data, use_cache=True)
    with pytest.raises(ValueError, match="return_dict=False"):
        pipe(**data, return_dict=False)
    with pytest.raises(ValueError, match="past_key_values"):
        pipe(**data, past_key_values=((torch.zeros(1),),))
    if "cache" in _takes(model):  # newer transformers name it cache=
        with pytest.raises(ValueError, match="was given cache"):
            pipe(**data, cache=transformers.DynamicCache())
    with pytest.raises(ValueError, match="is split by torch.export .* pass tracer='fx'"):
        Pipe(copy.deepcopy(ref), split_points=["transformer.h.1"], leaf_modules=["transformer.h.0"])
    # Another sequence length is exported again; the first split stays.
    check_loss(pipe, ref, batch(4, 6))
    exports = pipe.split_report().exports
    assert len(exports) == 2 and "input_ids (*, 6)" in exports[1]
    check_train_step(pipe, ref, data)
    assert len(pipe.split_report().exports) == 2


@pytest.mark.parametrize(
    ("points", "chunks"), [(["encoder.layer.1"], 2), (["encoder.layer.0", "pooler"], 4)]
)
def test_bert_with_an_attention_mask(points: list[str], chunks: int) -> None:
    model, ref = make(bert)
    data = batch(labels=False)
    target = torch.randn(5, 8, 32, dtype=torch.float64)
    pipe = Pipe(model, chunks=chunks, split_points=points, devices=["cpu"] * (len(points) + 1),
                sample=data)  # fmt: skip
    out = pipe(**data)
    expected = ref(**data)
    for key in ["last_hidden_state", "pooler_output"]:
        torch.testing.assert_close(out[key], expected[key], msg=key)
    (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
    (expected.last_hidden_state.sum() + expected.pooler_output.sum()).backward()
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    ref.zero_grad()

    def loss_fn(output: Any, y: Tensor) -> Tensor:
        return F.mse_loss(output.last_hidden_state, y)

    pipe.schedule = "1f1b"
    loss = pipe.train_step(data, target, loss_fn)
    expected_loss = loss_fn(ref(**data), target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach())
    assert_same_grads(pipe, ref)


class Wrapped(nn.Module):
    """The issue's two-line wrapper: a model returning a tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def test_a_wrapper_torch_fx_cannot_trace_falls_back_to_torch_export() -> None:
    model, ref = make(lambda: Wrapped(bert()))
    data = batch(labels=False)
    args = (data["input_ids"], data["attention_mask"])
    pipe = Pipe(model, chunks=3, split_points=["model.encoder.layer.1"], devices=["cpu"] * 2,
                sample=args)  # fmt: skip
    report = pipe.split_report()
    assert report.tracer == "torch.export" and "torch.fx could not trace it" in report.reason
    out = pipe(*args)
    expected = ref(*args)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_same_grads(pipe, ref)


def test_llama_gqa_rotary_and_every_checkpoint_mode() -> None:
    model, ref = make(llama)
    data = batch()
    pipe = Pipe(model, chunks=2, split_points=["model.layers.1", "model.layers.2"],
                devices=["cpu"] * 3, schedule="1f1b", sample=data)  # fmt: skip
    # The rotary frequencies are the model's buffer itself, in every stage reading them.
    inv_freq = model.model.rotary_emb.inv_freq
    readers = [p for p in pipe.partitions if any(b is inv_freq for b in p.buffers())]
    assert readers
    check_loss(pipe, ref, data)
    for mode in ["never", "except_last", "always"]:
        pipe.checkpoint = mode
        check_train_step(pipe, ref, data)


def test_llama_on_the_schedules_of_two_stages_per_rank() -> None:
    """One export, every schedule that places two stages per rank (round
    robin and V), as the guide says."""
    model, ref = make(lambda: llama(4))
    data = batch(8)
    pipe = Pipe(
        model, chunks=4, split_points=[f"model.layers.{i}" for i in (1, 2, 3)],
        devices=["cpu"] * 4, schedule="interleaved_1f1b", virtual_stages=2, sample=data,
    )  # fmt: skip
    for schedule in ["interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]:
        pipe.schedule = schedule
        check_train_step(pipe, ref, data)


def test_t5_encoder_decoder() -> None:
    model, ref = make(t5)
    data = batch()
    points = ["encoder.block.1", "decoder", "decoder.block.1"]
    pipe = Pipe(model, chunks=3, split_points=points, devices=["cpu"] * 4, sample=data)
    # The encoder's output goes straight to both decoder stages.
    assert [2 in r for r in pipe.graph.reads()] == [False, False, False, True]
    check_loss(pipe, ref, data)
    pipe.schedule = "1f1b"
    check_train_step(pipe, ref, data)


def test_the_users_own_loop_state_dict_and_num_items_in_batch() -> None:
    model, ref = make(llama)
    data = batch()
    pipe = Pipe(model, chunks=3, split_points=["model.layers.2"], devices=["cpu"] * 2,
                sample=data)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe(**data).loss
        loss.backward()
        opt.step()
        expected = ref(**data).loss
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, expected)
    # A checkpoint of the pipe loads into the unsplit model, and back.
    fresh = llama().double()
    fresh.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(fresh(**data).loss, ref(**data).loss)
    other = llama().double()
    pipe.load_state_dict(other.state_dict())
    torch.testing.assert_close(pipe(**data).loss, other(**data).loss)
    # The Trainer's normaliser: each micro-batch's summed loss over the batch's count.
    count = (data["labels"][:, 1:] != -100).sum()
    out = pipe(**data, num_items_in_batch=count)
    torch.testing.assert_close(out.loss, other(**data, num_items_in_batch=count).loss)
    # As a number it is an input too: another count exports nothing new,
    # and the loss keeps the model's dtype (numpy's float64 counts too).
    kinds = len(pipe.split_report().exports)
    for number in (int(count), int(count) + 1, float(count), np.float64(count), np.int64(5)):
        out = pipe(**data, num_items_in_batch=number)
        torch.testing.assert_close(out.loss, other(**data, num_items_in_batch=number).loss)
    assert len(pipe.split_report().exports) == kinds


def test_dropout_is_active_and_equal_with_one_micro_batch() -> None:
    model, ref = make(lambda: gpt2(dropout=0.1))
    data = batch()
    pipe = Pipe(model, split_points=["transformer.h.1"], devices=["cpu"] * 2, sample=data)
    # One micro-batch draws the dropout masks in the unsplit model's order.
    torch.manual_seed(3)
    one = pipe(**data)
    torch.manual_seed(3)
    torch.testing.assert_close(one.logits, ref(**data).logits)
    pipe.chunks = 2
    torch.manual_seed(3)
    two = pipe(**data)
    assert not torch.equal(two.logits, one.logits)  # other draws, dropout active
    pipe.eval()
    ref.eval()
    with torch.no_grad():
        evaluated = pipe(**data).loss
        torch.testing.assert_close(evaluated, ref(**data).loss)
    pipe.train()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        pipe.train_step(data)
        opt.step()
    pipe.eval()
    with torch.no_grad():
        assert pipe(**data).loss < evaluated  # it trains
    assert [e.split(",")[0] for e in pipe.split_report().exports] == ["training", "eval"]


def test_autocast() -> None:
    torch.manual_seed(0)
    model = llama()
    ref = copy.deepcopy(model)
    data = batch()
    pipe = Pipe(model, chunks=2, split_points=["model.layers.2"], devices=["cpu"] * 2,
                sample=data)  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(**data)
        expected = ref(**data)
    # The stages compute in bfloat16 as the model does; casts the model makes
    # from the dtypes it saw when exported (float32) stay: close, not equal.
    torch.testing.assert_close(out.loss, expected.loss, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0.1, atol=2e-2, msg=name)


def test_balance_time_picks_split_points_among_the_blocks() -> None:
    model, ref = make(gpt2)
    data = batch()
    pipe = Pipe(model, chunks=2, balance="time", devices=["cpu"] * 2, sample=data)
    (point,) = pipe.split_points
    assert point in ("transformer.h.0", "transformer.h.1", "lm_head")
    check_loss(pipe, ref, data)


def test_tied_embeddings_on_two_devices_are_refused_by_name() -> None:
    model, _ = make(gpt2)
    split = ExportSplit(model, ["transformer.h.1"], [torch.device("cpu"), torch.device("meta")],
                        "test")  # fmt: skip
    with pytest.raises(ValueError) as info:
        split.first(batch())
    message = str(info.value)
    assert "transformer.wte.weight = lm_head.weight is used by stage 0 (cpu), stage 1" in message
    assert "tie_word_embeddings=False" in message
    assert all(p.device.type == "cpu" for p in model.parameters())  # nothing moved


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_llama() -> None:
    model, ref = make(llama)
    data = batch()
    pipe = Pipe(model, chunks=3, split_points=["model.layers.2"], devices=["cuda:0", "cuda:1"],
                sample=data)  # fmt: skip
    out = pipe(**data)
    expected = ref(**data)
    torch.testing.assert_close(out.loss.cpu(), expected.loss)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, msg=name)
    pipe.eval()  # a second split, exported after the placement
    with torch.no_grad():
        torch.testing.assert_close(pipe(**data).logits.cpu(), ref.eval()(**data).logits)
