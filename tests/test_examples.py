"""The examples run as documented (tiny sizes, CPU)."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _exit_of(
    script: str,
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[object, str]:
    """An example run in this process as ``python examples/SCRIPT ARGS``
    would run it, to a refusal before any work: its exit code and standard
    error. (A Python each, as the runs above, would take seconds to import
    torch for a line of argparse.)"""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / script), *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "args"),
    [
        (
            "transformer.py",
            ["--steps", "2", "--batch-size", "4", "--context", "8", "--width", "16"],
        ),
        (
            "unet.py",
            ["--steps", "2", "--batch-size", "4", "--image-size", "16", "--split-size", "2"],
        ),
    ],
)
def test_example_trains_and_matches_the_unsplit_model(script: str, args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--devices", "cpu,cpu,cpu,cpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equals the unsplit model's" in result.stdout
    assert "step   2" in result.stdout


def test_the_hugging_face_example_trains_equal_to_the_unsplit_model() -> None:
    pytest.importorskip("transformers")
    args = ["--steps", "2", "--batch-size", "4", "--context", "8", "--width", "16", "--train-step"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--devices", "cpu,cpu",
         *args],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "split by torch.export" in result.stdout
    assert "equals the unsplit model's" in result.stdout
    assert "step   2" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_the_cuda_graph_experiment_says_it_needs_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_of("cuda_graph_step.py", [], monkeypatch, capsys)
    assert code == 1 and "needs a CUDA device" in err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_graph_experiment_reports_every_attempt(tmp_path: Path) -> None:
    out = tmp_path / "graph.json"
    args = ["--batch-size", "8", "--image-size", "64", "--split-size", "4", "--runs", "2"]
    args += ["--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cuda_graph_step.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    attempts = report["attempts"]
    assert attempts and all(a["eager_ms"] > 0 for a in attempts)
    assert "error" not in attempts[-1] or len(attempts) == 3  # stops at the first that works


def test_examples_refuse_sizes_below_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse's refusal: exit code 2 and one line, no traceback.
    code, err = _exit_of("unet.py", ["--split-size", "0"], monkeypatch, capsys)
    assert code == 2
    assert "--split-size: must be at least 1, got 0" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("unet.py", ["--devices", "cpu,cuda:99,cpu,cpu"], "cuda:99: no such device here"),
        ("transformer.py", ["--devices", "cpu,tpu,cpu,cpu"], "'tpu' is not a device name"),
        ("balance_resnet50.py", ["--device", "cuda:99"], "cuda:99: no such device here"),
    ],
)
def test_examples_refuse_devices_this_machine_lacks(
    script: str,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _exit_of(script, args, monkeypatch, capsys)
    assert code == 2 and message in err, err[-2000:]


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("unet.py", ["--devices", "cpu"], "give 4 devices"),
        ("unet.py", ["--image-size", "7"], "must divide by 4"),
        ("transformer.py", ["--width", "10"], "must divide by the 4 attention heads"),
        ("balance_resnet50.py", ["--batch-size", "1"], "at least 2"),
        ("balance_resnet50.py", ["--stages", "24"], "ResNet50 has 23 blocks"),
    ],
)
def test_example_sizes_they_cannot_run_are_argparse_errors(
    script: str,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _exit_of(script, args, monkeypatch, capsys)
    assert code == 2 and message in err, err[-2000:]


@pytest.mark.parametrize(
    ("script", "option", "old"),
    [
        ("transformer.py", "--batch-size", "--batch"),
        ("hf_causal_lm.py", "--batch-size", "--batch"),
        ("unet.py", "--batch-size", "--batch"),
        ("unet.py", "--image-size", "--size"),
        ("balance_resnet50.py", "--batch-size", "--batch"),
        ("balance_resnet50.py", "--image-size", "--image"),
        ("cuda_graph_step.py", "--batch-size", "--batch"),
        ("cuda_graph_step.py", "--image-size", "--image"),
        ("cuda_graph_step.py", "--num-classes", "--classes"),
    ],
)
def test_examples_name_sizes_as_the_cli_does_and_keep_the_old_spelling(
    script: str,
    option: str,
    old: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The CLI's name first, the old one still parsed into the same option:
    # a value below one reaches the same check under either spelling.
    for given in (option, old):
        code, err = _exit_of(script, [given, "0"], monkeypatch, capsys)
        assert code == 2, err[-2000:]
        assert f"argument {option}/{old}: must be at least 1, got 0" in err, err[-2000:]


# Options with no default to show: optional outputs and limits.
NO_DEFAULT = {"--json"}
NO_DEFAULT_IN = {"ddp_pipeline.py": {"--steps", "--split-size", "--virtual-stages"}}


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_every_example_help_says_what_it_does_and_each_default(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The README sends users to --help: the description is a whole
    # sentence, and an option taking a value says its default.
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / script), "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    out = capsys.readouterr().out
    assert exited.value.code == 0, out
    description = out.split("\n\n")[1]
    assert description.endswith("."), description
    exempt = NO_DEFAULT | NO_DEFAULT_IN.get(script, set())
    for entry in out[out.index("options:") :].split("\n  -")[1:]:
        words = entry.split()
        name = "-" + words[0].rstrip(",")  # the split took its first dash
        takes_value = len(words) > 1 and words[1].isupper()
        if takes_value and name not in exempt:
            assert "default" in " ".join(words), f"{script} {name}: {entry}"


def test_the_readme_names_every_example_and_two_commands_first() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f"(examples/{script.name})" in readme, f"README does not list {script.name}"
    start = readme.index("## Quick start")
    block = readme[readme.index("```bash", start) : readme.index("```\n", start + 20)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:]]
    assert [c for c in commands if c] == ["make run", "make test"]


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_the_ddp_example_gives_virtual_stages_to_every_schedule_that_takes_them(
    schedule: str,
) -> None:
    # build_pipe alone: the rest of the example needs torchrun.
    example = runpy.run_path(str(ROOT / "examples" / "ddp_pipeline.py"), run_name="example")
    args = argparse.Namespace(
        num_classes=10, balance=None, stages=4, chunks=2, split_size=None,
        schedule=schedule, checkpoint="never", virtual_stages=2,
    )  # fmt: skip
    pipe = example["build_pipe"](args, [torch.device("cpu")] * 4)
    assert pipe.virtual_stages == 2


def test_the_ddp_example_names_its_own_flag_for_a_schedule_that_needs_virtual_stages() -> None:
    example = runpy.run_path(str(ROOT / "examples" / "ddp_pipeline.py"), run_name="example")
    args = argparse.Namespace(
        num_classes=10, balance=None, stages=2, chunks=2, split_size=None,
        schedule="zbv", checkpoint="never", virtual_stages=None,
    )  # fmt: skip
    with pytest.raises(SystemExit, match=r"--schedule zbv: .*virtual_stages=2.*--virtual-stages"):
        example["build_pipe"](args, [torch.device("cpu")] * 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--width", "10"], "must divide by the 4 attention heads"),
        (["--context", "1"], "at least 2 (each token predicts the next)"),
    ],
)
def test_the_hugging_face_example_refuses_sizes_it_cannot_train(
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    code, err = _exit_of("hf_causal_lm.py", args, monkeypatch, capsys)
    assert code == 2 and message in err, err[-2000:]


def test_every_sequence_of_the_hugging_face_example_has_a_token_to_predict() -> None:
    pytest.importorskip("transformers")
    example = runpy.run_path(str(ROOT / "examples" / "hf_causal_lm.py"), run_name="example")
    torch.manual_seed(0)
    labels = example["batch_of"](64, 2, 97)["labels"]
    assert (labels[:, 1] != -100).all()  # the second token: the first one's target


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "24"], "--stages 24: ResNet50 has 23 blocks"),
        (["--balance", "11,x"], "--balance 11,x: expected layer counts"),
        (["--stages", "4", "--balance", "11,12"], "--balance 11,12: 2 stages, but --stages 4"),
        (["--balance", "10,10"], "--balance 10,10: must add up to ResNet50's 23 blocks"),
    ],
)
def test_the_ddp_example_refuses_stages_and_balances_before_starting(
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Refused by argparse at once, not by every process's Pipe after the rendezvous.
    example = runpy.run_path(str(ROOT / "examples" / "ddp_pipeline.py"), run_name="example")
    monkeypatch.setattr(sys, "argv", ["ddp_pipeline.py", *args])
    with pytest.raises(SystemExit) as exited:
        example["parse_args"]()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def _torchrun_example(cwd: Path, *args: str) -> str:
    """examples/ddp_pipeline.py run by torchrun, two CPU processes; its output."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "ddp_pipeline.py"),
        "--cpu",
        "--stages=2",
        "--steps=1",
        "--batch-size=4",
        "--image-size=32",
        "--dataset-size=16",
        "--num-classes=10",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240.0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replicas in sync: yes" in done.stdout, done.stdout
    return done.stdout


@pytest.mark.slow
def test_the_ddp_example_trains_saves_and_resumes_under_torchrun(tmp_path: Path) -> None:
    once = _torchrun_example(tmp_path, "--epochs=2", "--ckpt=once.pt")
    assert "epoch 1 step 0 loss" in once
    _torchrun_example(tmp_path, "--epochs=1", "--ckpt=twice.pt")
    resumed = _torchrun_example(tmp_path, "--epochs=2", "--ckpt=twice.pt", "--resume")
    assert "resumed from twice.pt at epoch 1" in resumed
    assert "epoch 0 step" not in resumed
    # Stopping after epoch 0 and resuming trains exactly as running through.
    a = torch.load(tmp_path / "once.pt", weights_only=True)
    b = torch.load(tmp_path / "twice.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    momentum_a, momentum_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert momentum_a.keys() == momentum_b.keys()
    for index in momentum_a:
        assert torch.equal(
            momentum_a[index]["momentum_buffer"], momentum_b[index]["momentum_buffer"]
        ), f"momentum of parameter {index}"
