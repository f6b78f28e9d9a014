"""Where a run computes (--device, --precision). The default suite runs on
CPU; the tests marked gpu run where CUDA is present and skip elsewhere."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from clinfed.device import resolve_device

from .test_cli import TINY_FEDERATED, run_cli

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2_with_one_line(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                     "--device", "cuda", "--data", str(i2b2_corpus), "--out", str(out))  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: this machine has no CUDA device" in lines[0]
    assert "Traceback" not in result.stderr and not out.exists()
    assert resolve_device("auto") == torch.device("cpu")


def test_device_cpu_and_bf16_without_dp_train_and_bf16_under_dp_is_refused(i2b2_corpus, tmp_path):
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
            "--data", str(i2b2_corpus))  # fmt: skip
    assert run_cli(*args, "--device", "cpu", "--out", str(tmp_path / "cpu")).returncode == 0
    bf16 = run_cli(*args, "--precision", "bf16", "--out", str(tmp_path / "bf16"))
    assert bf16.returncode == 0, bf16.stderr
    refused = run_cli(*args, "--precision", "bf16", "--target-epsilon", "8",
                      "--out", str(tmp_path / "dp"))  # fmt: skip
    assert refused.returncode == 2 and "--precision bf16 under DP" in refused.stderr
    bad = run_cli(*args, "--device", "tpu", "--out", str(tmp_path / "tpu"))
    assert bad.returncode == 2 and "expected auto, cpu, cuda or cuda:N" in bad.stderr


def _weights(run):
    return load_file(str(run / "model" / "model.safetensors"))


@gpu
@pytest.mark.parametrize("dp", [False, True])  # DP: book-keeping clipping, the same noise
def test_a_round_on_cpu_and_on_gpu_gives_the_same_weights(i2b2_corpus, tmp_path, dp):
    private = ("--target-epsilon", "8", "--reproducible-noise", "--clipping", "bk") if dp else ()
    runs = {}
    for device in ("cpu", "cuda"):
        runs[device] = tmp_path / device
        result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                         *private, "--device", device, "--data", str(i2b2_corpus),
                         "--out", str(runs[device]))  # fmt: skip
        assert result.returncode == 0, result.stderr
    ours, theirs = _weights(runs["cuda"]), _weights(runs["cpu"])
    for name, value in theirs.items():
        assert torch.allclose(ours[name], value, rtol=1e-4, atol=1e-6), name


@gpu
def test_the_digest_of_the_same_weights_is_the_same_on_every_device():
    from clinfed.federated import payload
    from clinfed.models import build_model

    model = build_model("token", "tiny", 5)
    cpu_digest = payload.digest(model.state_dict())
    model.to("cuda")
    assert payload.digest(model.state_dict()) == cpu_digest
