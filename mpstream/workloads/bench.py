"""``mpstream bench --model transformer``: the workload's ways to train, side by side.

One training step (forward, next-token loss, backward, AdamW) of the
transformer preset, timed in interleaved rounds (:func:`~mpstream.tutorial.rounds.round_robin`,
groups where they do not all fit): the single device; naive model parallel
(the same two-stage split, the whole batch, the default stream: what a
``device_map`` user runs); mpstream's eager ``train_step`` with each schedule
of :data:`SCHEDULES`; and on a GPU its graphed stages (``graphs=True``,
1F1B), each pipeline over the preset's micro-batch counts, with their own
baseline: the single device's whole step captured as one CUDA graph
(:class:`~mpstream.CapturedStep`, AdamW ``capturable``), so graphed is
compared with graphed. Per configuration:
tokens per second, the ratio to each baseline, model FLOPs utilisation
against the dense bf16 peaks of the devices it uses, summed (:func:`peaks`; FLOPs from
:func:`~mpstream.workloads.transformer.flops_per_token`), the host's issue
share of the step and memory per stage (:mod:`.memory`); :mod:`.report`
derives the figures and writes them.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import CapturedStep
from ..pipe import Pipe, SingleMicroBatchWarning
from ..runtime import GraphWarning, synchronize
from ..tutorial import machine, rounds
from . import memory as stage_memory
from .transformer import NaiveParallel, Preset, decoder, halves, loss_fn, seeded, tokens

__all__ = [
    "SCHEDULES",
    "SINGLE",
    "NAIVE",
    "CAPTURED",
    "GRAPHED",
    "Config",
    "Measured",
    "Results",
    "keys_for",
    "label",
    "peak_tflops",
    "peaks",
    "run",
]

SCHEDULES = ("gpipe", "1f1b", "zb_h1")
SINGLE, NAIVE, GRAPHED = "single device", "naive model parallel", "graphed stages"
#: Graphed stages' baseline: the single device's step replayed as one graph.
CAPTURED = "captured single device"
HF = "Hugging Face Llama"
#: Dense bf16 peaks (TFLOP/s) by a part of the device's name, first match
#: wins (so the NVL and PCIe parts, slower than the SXM ones, come first).
PEAKS = (("H200 NVL", 835.5), ("H200", 989.4), ("H100 NVL", 835.5), ("H100 PCIe", 756.0),
         ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0))  # fmt: skip

# A configuration: (variant, schedule, micro-batches); the baselines have neither.
Key = tuple[str, str | None, int | None]


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, if its name is known (else None: MFU is
    not reported; ``--peak-tflops`` gives it)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAKS if part in name), None)


def peaks(config: Config) -> dict[str, float | None]:
    """Each of the configuration's devices' dense bf16 peak, by device
    (``config.peak`` for every one where given, else :func:`peak_tflops`):
    what MFU sums over the devices a configuration uses."""
    return {str(d): config.peak or peak_tflops(d) for d in config.devices}


@dataclass(frozen=True)
class Config:
    """What ``mpstream bench --model transformer`` runs.

    Attributes:
        preset: the model, batch and micro-batch counts.
        devices: the two stages' devices (both halves on one device run
            the same data flow, nothing in parallel).
        graphed: time graphed stages too (only where stages sit on GPUs).
        hf: time ``transformers``' ``LlamaForCausalLM`` of the same sizes
            (no weights loaded), split by ``torch.export``, 1F1B, too (where
            ``transformers`` is installed).
        peak: the dense bf16 peak for MFU of every device, in TFLOP/s
            (None: each device's by its name).
    """

    preset: Preset
    devices: tuple[torch.device, torch.device]
    graphed: bool = True
    hf: bool = True
    peak: float | None = None


@dataclass
class Measured:
    """One configuration's steps: seconds per step, host issue time, memory."""

    key: Key
    times: list[float]
    issue: list[float]
    group: int = 0
    memory: list[dict[str, int]] = field(default_factory=list)
    device_peaks: dict[str, int] = field(default_factory=dict)
    eager: str = ""  # graphed configurations only: why one ran eagerly, if it did

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> rounds.Spread:
        return rounds.spread(self.times)


@dataclass
class Results:
    config: Config
    measured: dict[Key, Measured]
    meta: dict[str, Any]
    #: Configurations that did not fit in device memory even alone, each
    #: with why (a single device that cannot hold the model, say).
    unfit: dict[Key, str] = field(default_factory=dict)
    #: Whether an interrupt ended the timing early: what ran is measured,
    #: some configurations with fewer rounds, others not at all.
    interrupted: bool = False

    def not_timed(self) -> list[Key]:
        """The configurations with no timed round that did fit (an
        interrupted run's)."""
        return [k for k in keys_for(self.config) if k not in self.measured and k not in self.unfit]

    def tokens_per_s(self, key: Key) -> float:
        return self.config.preset.tokens / self.measured[key].median


def keys_for(config: Config) -> list[Key]:
    """Every configuration: the baselines (on GPUs with graphs, the
    captured single device too), then each schedule and graphed stages over
    the micro-batch counts."""
    graphed = config.graphed and all(d.type == "cuda" for d in config.devices)
    keys: list[Key] = [(SINGLE, None, None), (NAIVE, None, None)]
    if graphed:
        keys.append((CAPTURED, None, None))
    for m in dict.fromkeys(config.preset.micro_batches):  # a preset listing 2 twice: once
        keys += [("mpstream", s, m) for s in SCHEDULES]
        if graphed:
            keys.append((GRAPHED, "1f1b", m))
        if config.hf and m == max(config.preset.micro_batches) and _has_transformers():
            keys.append((HF, "1f1b", m))  # one count: its export costs a capture's time
    return keys


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def label(key: Key) -> str:
    variant, schedule, m = key
    if schedule is None:
        return variant
    name = f"mpstream {schedule}" if variant == "mpstream" else f"{variant} ({schedule})"
    return f"{name}, {m} micro-batches"


def on_one_device(variant: str) -> bool:
    """Whether a configuration of ``variant`` runs on the first device only."""
    return variant in (SINGLE, CAPTURED)


class _Runner:
    """One configuration built: its module, optimizer and step."""

    def __init__(self, key: Key, config: Config) -> None:
        p, (dev0, dev1) = config.preset, config.devices
        variant, schedule, m = key
        self.devices = [dev0] if on_one_device(variant) else [dev0, dev1]
        self.x, self.y = tokens(p, dev0)
        self.batch: dict[str, Tensor] | None = None
        self.captured: CapturedStep | None = None
        self.eager = ""  # the captured single device: why its capture failed, if it did
        if variant == HF:
            self.batch = {"input_ids": self.x, "labels": self.x}
            self.module: nn.Module = _hf_pipe(p, [dev0, dev1], m or 1, self.batch)
        elif variant == SINGLE:
            self.module = decoder(p, dev0)
        elif variant == CAPTURED:
            # One stage, one micro-batch: the single device's step, which
            # CapturedStep captures whole (on the CPU it runs eagerly).
            whole = [sum(halves(p))]
            self.module = Pipe(
                decoder(p, dev0), balance=whole, devices=[dev0], chunks=1, checkpoint="never"
            )
        elif variant == NAIVE:
            self.module = NaiveParallel(decoder(p, dev0), halves(p), [dev0, dev1])
        else:
            self.module = Pipe(
                decoder(p, dev0), balance=halves(p), devices=[dev0, dev1], chunks=m,
                schedule=schedule or "1f1b", checkpoint="never", graphs=variant == GRAPHED,
            )  # fmt: skip
        self.pipe = self.module if isinstance(self.module, Pipe) else None
        fused = all(d.type == "cuda" for d in self.devices)
        self.opt = torch.optim.AdamW(
            self.module.parameters(), lr=1e-4, fused=fused, capturable=fused and variant == CAPTURED
        )
        self.y = self.y.to(self.devices[-1])
        self.dtype = p.dtype
        self.issue: list[float] = []
        if variant == CAPTURED:
            self.captured = self._capture()

    def _capture(self) -> CapturedStep | None:
        """The step captured (None where capture failed: it then runs
        eagerly, and :attr:`eager` says why).

        Raises:
            torch.cuda.OutOfMemoryError: capture ran out of device memory
                (it may fit with fewer configurations held).
        """
        assert isinstance(self.module, Pipe)
        # Autocast's weight cache does not survive capture.
        with _autocast(self.devices[0], self.dtype, cache_enabled=False):
            try:
                return CapturedStep(self.module, self.x, self.y, loss_fn, optimizer=self.opt)
            except RuntimeError as e:
                if rounds.out_of_memory(e):
                    raise
                self.eager = f"its capture failed ({str(e).splitlines()[0]})"
                return None

    @property
    def graph_bytes(self) -> int:
        """The captured step's graph pool's bytes (0: no graph)."""
        return 0 if self.captured is None else self.captured.reserved_bytes

    @property
    def static_bytes(self) -> int:
        """The captured step's static input and target buffers, outside its
        pool (0: no captured step, the pipe's eager step runs)."""
        return 0 if self.captured is None else self.captured.static_bytes

    def step(self) -> None:
        if self.captured is not None:
            with _autocast(self.devices[0], self.dtype):  # for the CPU's eager steps
                self.captured(self.x, self.y)  # zeroes, trains and steps AdamW
            return
        self.opt.zero_grad(set_to_none=True)
        with _autocast(self.devices[0], self.dtype):
            if self.batch is not None:
                self.pipe.train_step(self.batch)  # type: ignore[union-attr]
            elif self.pipe is not None:
                self.pipe.train_step(self.x, self.y, loss_fn)
            else:
                loss_fn(self.module(self.x), self.y).backward()  # type: ignore[no-untyped-call]
        self.opt.step()

    def timed(self) -> float:
        synchronize(self.devices)
        start = time.perf_counter()
        self.step()
        issued = time.perf_counter()
        synchronize(self.devices)
        end = time.perf_counter()
        self.issue.append(issued - start)
        return end - start


def _hf_pipe(p: Preset, devices: list[torch.device], chunks: int, batch: dict[str, Tensor]) -> Pipe:
    """``LlamaForCausalLM`` of preset ``p``'s sizes, split in half by ``torch.export``."""
    from transformers import LlamaConfig, LlamaForCausalLM, logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=p.vocab, hidden_size=p.width, intermediate_size=p.hidden,
        num_hidden_layers=p.depth, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.seq, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    # Drawn on the GPU: on the CPU, 1b's weights took seconds (as decoder's).
    with seeded(0), torch.device(devices[0]):
        model = LlamaForCausalLM(config)
    return Pipe(
        model, chunks=chunks, split_points=[f"model.layers.{p.depth // 2}"], devices=devices,
        schedule="1f1b", checkpoint="never", sample=batch,  # type: ignore[arg-type]
    )  # fmt: skip


def _autocast(device: torch.device, dtype: torch.dtype | None, cache_enabled: bool = True) -> Any:
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache_enabled)


def run(
    config: Config,
    tick: Callable[[], None] | None = None,
    status: Callable[[str], None] | None = None,
    interruptible: bool = False,
) -> Results:
    """Builds and times every configuration (see the module). Each one's
    memory per stage is measured as it is built, in a step of its own; one
    that does not fit in device memory even alone is left out and named in
    the results' ``unfit`` (the single device, for a model only a pipeline
    holds). With ``interruptible``, a ``KeyboardInterrupt`` while building
    or timing ends the run with what was timed so far (``interrupted``);
    else it propagates."""
    p = config.preset
    keys = keys_for(config)
    memory: dict[Key, tuple[list[dict[str, int]], dict[str, int]]] = {}
    issues: dict[Key, list[float]] = {}
    eager: dict[Key, str] = {}  # graphed configurations whose capture failed, why

    def build(key: Key) -> _Runner:
        # Nothing here may hold the runner: round_robin frees a timed group
        # to make room for the next, and a 1b configuration's weights, grads
        # and AdamW state alone are 17.6 GB (they do not all fit on a GPU).
        # So memory is measured now, not after the timing; the allocator's
        # peak less what the configurations already held had allocated.
        gpus = sorted({d for d in config.devices if d.type == "cuda"}, key=str)
        held = {str(d): torch.cuda.memory_allocated(d) for d in gpus}
        runner = _Runner(key, config)
        runner.step()  # the optimizer's state made, graphs captured: a steady step next
        stages, peaks = stage_memory.per_stage(
            runner.module,
            runner.opt,
            runner.step,
            runner.devices,
            runner.graph_bytes,
            runner.static_bytes,
        )
        memory[key] = stages, {d: peak - held[d] for d, peak in peaks.items()}
        issues[key] = runner.issue
        return runner

    load = {"before": rounds.machine_load()}
    with warnings.catch_warnings():
        # A graphed stage whose capture failed runs eagerly with a
        # GraphWarning; check turns that into NoRoom, or says it beside the
        # times (an error would lose every other configuration's).
        warnings.filterwarnings("ignore", ".* runs eagerly: ", GraphWarning)
        # A configuration of one micro-batch is measured on purpose.
        warnings.simplefilter("ignore", SingleMicroBatchWarning)
        timed = rounds.round_robin(
            keys, build, _Runner.timed, warmup=p.warmup, repeat=p.repeat, label=label,
            check=lambda key, runner: eager.__setitem__(key, _eager(key, runner)),
            tick=tick, status=status, skip_unfit=True, interruptible=interruptible,
        )  # fmt: skip
    measured: dict[Key, Measured] = {}
    for key in (k for k in keys if k in timed.times):
        m = Measured(key, timed.times[key], issues[key][p.warmup :], timed.group[key])
        m.eager = eager.get(key, "")
        m.memory, m.device_peaks = memory[key]
        measured[key] = m
    load["after"] = rounds.machine_load()
    meta = machine.metadata(list(config.devices))
    meta["load"] = load
    meta["peak_tflops"] = peaks(config)
    return Results(config, measured, meta, timed.unfit, timed.interrupted)


def _eager(key: Key, runner: _Runner) -> str:
    """Why a graphed configuration runs eagerly (a capture failed: its times
    are an eager step's); empty where it replays graphs, and for the other
    configurations.

    Raises:
        rounds.NoRoom: a capture ran out of device memory (it may fit with
            fewer configurations held).
    """
    if key[0] == CAPTURED:
        return runner.eager
    if key[0] != GRAPHED or runner.pipe is None:
        return ""
    for stage in runner.pipe.graph_report().stages:
        if not stage.graphed:
            why = f"stage {stage.stage} runs eagerly ({stage.reason})"
            if rounds.says_out_of_memory(stage.reason or ""):
                raise rounds.NoRoom(why)
            return why
    return ""
