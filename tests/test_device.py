"""Where a run computes (--device, --precision). The default suite runs on
CPU; the tests marked gpu run where CUDA is present and skip elsewhere."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from clinfed.core.device import resolve_device

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


def _update(run) -> torch.Tensor:
    """Every weight's change over the run: its model less the one it started
    from (rebuilt from the run's config, as the audit does), flattened."""
    import tempfile

    from clinfed.modeling.models import load_saved_model
    from clinfed.runners.audit import starting_model
    from clinfed.runners.factories import make_task
    from clinfed.settings import RunConfig, read_run_config

    config = RunConfig.from_values(read_run_config(run), "config").resolved()
    _, tokenizer, meta = load_saved_model(run / "model")
    with tempfile.TemporaryDirectory() as cache:
        task = make_task(config, cache)
        task.labels = list(meta["labels"])
        initial = starting_model(config, task, tokenizer, cache).state_dict()
    trained = load_file(str(run / "model" / "model.safetensors"))
    return torch.cat([(trained[n].double() - initial[n].double().cpu()).flatten() for n in trained])


def _apart(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


# The same round on two devices is not bit for bit the same (the order of
# floating-point sums differs), and AdamW turns the sign of a near-zero
# gradient into a whole step, so a weight whose gradient is nearly zero can
# step the other way: the first GPU run (H200, 2026-11-25) found single
# LayerNorm biases 50% apart. What a device bug would change (other data,
# batches or noise) moves the whole update instead: a second seed on the
# same CPU puts it far past this bound (test below).
SAME_ROUND = 0.25


def _round(i2b2_corpus, out, device, dp, *extra):
    # DP: book-keeping clipping, which draws the noise on the CPU (the same on
    # every device); it needs one row per sentence, so no line may fold.
    private = ("--target-epsilon", "8", "--reproducible-noise", "--clipping", "bk",
               "--max-length", "128") if dp else ()  # fmt: skip
    result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                     *private, *extra, "--device", device, "--data", str(i2b2_corpus),
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    return _update(out)


# The DP case (book-keeping clipping over 128-token rows) is the slow half:
# the GPU comparison it calibrates is skipped on a machine without one.
@pytest.mark.parametrize("dp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_another_seed_moves_a_round_past_the_device_bound(i2b2_corpus, tmp_path, dp):
    first = _round(i2b2_corpus, tmp_path / "a", "cpu", dp)
    again = _round(i2b2_corpus, tmp_path / "b", "cpu", dp)
    assert _apart(again, first) == 0.0  # the CPU repeats itself exactly
    other = _round(i2b2_corpus, tmp_path / "c", "cpu", dp, "--seed", "1")
    assert _apart(other, first) > 2 * SAME_ROUND


@gpu
@pytest.mark.parametrize("dp", [False, True])
def test_a_round_on_cpu_and_on_gpu_gives_the_same_update(i2b2_corpus, tmp_path, dp):
    cpu = _round(i2b2_corpus, tmp_path / "cpu", "cpu", dp)
    cuda = _round(i2b2_corpus, tmp_path / "cuda", "cuda", dp)
    assert _apart(cuda, cpu) < SAME_ROUND


@gpu
def test_the_digest_of_the_same_weights_is_the_same_on_every_device():
    from clinfed.core import payload
    from clinfed.modeling.models import build_model

    model = build_model("token", "tiny", 5)
    cpu_digest = payload.digest(model.state_dict())
    model.to("cuda")
    assert payload.digest(model.state_dict()) == cpu_digest


def test_a_dp_pass_holds_what_half_the_free_memory_fits():
    from torch import nn

    from clinfed.core.device import pass_units_for

    model = nn.Linear(1000, 1000)  # 1,001,000 trainable numbers: 4 MB a unit
    assert pass_units_for(model) == 0  # on the CPU: no cap
    assert pass_units_for(model, free_bytes=8 * 4_004_000) == 4  # half of 8 units' worth
    assert pass_units_for(model, free_bytes=10) == 1  # never below one unit
    model.weight.requires_grad_(False)  # only the bias trains: 1,000 numbers
    assert pass_units_for(model, free_bytes=8 * 4_004_000) == 4004
