"""pfeddc: personalized prompts on a frozen encoder; only P_g travels."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from clinfed.core import payload
from clinfed.federated.strategies.pfeddc import PFedDC
from clinfed.modeling.blocks import GLOBAL_PROMPT, LOCAL_PROMPT, block_of
from clinfed.modeling.models import add_prompts, build_model, load_saved_model
from clinfed.modeling.prompts import DualPrompt
from clinfed.runners.pipeline import RunConfig, run_training

from .test_cli import run_cli


def test_only_the_global_prompt_travels_and_it_is_under_1pct_of_fedavg_for_minilm():
    model = add_prompts(build_model("token", "minilm", 7), 8, "attention", depth=6)
    names = [n for n, _ in model.named_parameters()]
    plan = PFedDC().plan(3, "beth", names)
    assert (
        plan.uploaded == plan.downloaded == {f"prompt.global_prompt.{i}.weight" for i in range(6)}
    )
    assert {block_of(n) for n in plan.trainable} >= {GLOBAL_PROMPT, LOCAL_PROMPT}
    assert not any(n.startswith("encoder.") for n in plan.trainable)  # frozen encoder
    params = dict(model.named_parameters())
    upload = len(payload.encode({n: params[n] for n in plan.uploaded}))
    fedavg = len(payload.encode(params))
    assert upload < 0.01 * fedavg


def test_fusion_starts_from_the_global_prompt_and_modes_change_the_prompt_length():
    prompt = DualPrompt(16, length=4, fusion="attention")
    index = torch.arange(4).unsqueeze(0)
    assert torch.equal(prompt(1), prompt.global_prompt[0](index))  # W_o = 0 at start
    assert DualPrompt(16, 4, "concat")(2).shape == (2, 8, 16)
    alone = DualPrompt(16, 4, "global")
    assert alone.local_prompt is None and alone(3).shape == (3, 4, 16)
    concat = DualPrompt(16, 4, "concat")
    concat.global_only = True
    assert concat.tokens == 4 and concat(1).shape == (1, 4, 16)


def test_deep_prompts_steer_every_layer_and_leave_no_hooks_behind():
    torch.manual_seed(0)
    ids = torch.tensor([[2, 5, 6, 7, 3]])
    mask = torch.ones_like(ids)
    shallow = add_prompts(build_model("token", "tiny", 7), 3, "attention", depth=1).eval()
    deep = add_prompts(build_model("token", "tiny", 7), 3, "attention", depth=2).eval()
    deep.prompt.global_prompt[0].load_state_dict(shallow.prompt.global_prompt[0].state_dict())
    assert not torch.allclose(shallow(ids, mask), deep(ids, mask))
    with torch.no_grad():  # the second layer's prompt reaches the output
        before = deep(ids, mask)
        deep.prompt.global_prompt[1].weight.add_(1.0)
        assert not torch.allclose(before, deep(ids, mask))
    layers = deep.encoder.encoder.layer
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_prompted_model_is_saved_and_rebuilt(tmp_path):
    from clinfed.modeling.models import load_tokenizer, save_model

    model = add_prompts(build_model("token", "tiny", 7), 3, "concat", depth=2)
    save_model(
        model,
        tmp_path / "m",
        {"task": "i2b2", "head": "token", "labels": ["x"] * 7},
        load_tokenizer("tiny"),
    )
    rebuilt, _, meta = load_saved_model(tmp_path / "m")
    assert meta["prompt"] == {"length": 3, "fusion": "concat", "depth": 2}
    ids = torch.tensor([[2, 5, 6, 3]])
    mask = torch.ones_like(ids)
    model.eval(), rebuilt.eval()
    torch.testing.assert_close(model(ids, mask), rebuilt(ids, mask))


def test_pfeddc_run_uploads_only_the_global_prompt(i2b2_corpus, tmp_path, traffic):
    summary = run_training(
        RunConfig.of(
            task="i2b2",
            data=str(i2b2_corpus),
            out=str(tmp_path / "run"),
            strategy="pfeddc",
            model="tiny",
            rounds=2,
            threads=1,
        )
    )
    # Both ways, every message carried the global prompt and nothing else.
    assert traffic.messages
    for message in traffic.messages:
        for keys in (message["down"], message["up"]):
            assert all(k.startswith("prompt.global_prompt.") for k in keys)
    assert all(m["up"] for m in traffic.messages if m["kind"] == "train")
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    rounds = [r for r in records if "site" not in r]
    assert all("global_prompt_f1" in r and "per_site_f1" in r for r in rounds)
    assert summary["ratio_to_fedavg_up"] < 0.01


ARGS = [
    "--task",
    "i2b2",
    "--strategy",
    "pfeddc",
    "--model",
    "tiny",
    "--rounds",
    "3",
    "--threads",
    "1",
]


@pytest.mark.slow  # the in-process SIGKILL resume test runs by default (test_resume.py)
def test_local_state_survives_sigkill_and_resume(i2b2_corpus, tmp_path):
    whole = tmp_path / "whole"
    reference = run_cli("train", *ARGS, "--data", str(i2b2_corpus), "--out", str(whole))
    assert reference.returncode == 0, reference.stderr

    run = tmp_path / "killed"
    code = "import sys; from clinfed.commands import main; sys.exit(main())"
    args = ["train", *ARGS, "--data", str(i2b2_corpus), "--out", str(run)]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # Kill once a site has trained round 2 (its copy of global round 1, with
    # its own local prompt, fusion and head, is saved) before round 2 commits.
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list((run / "sites").glob("*/copy.r0001.safetensors")):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((run / "state.json").read_text())["round"] == 1

    resumed = run_cli("train", *ARGS, "--data", str(i2b2_corpus), "--out", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    for site in ("beth", "partners", "site3"):
        a = load_file(str(whole / "sites" / site / "copy.r0003.safetensors"))
        b = load_file(str(run / "sites" / site / "copy.r0003.safetensors"))
        local = [k for k in a if block_of(k) == LOCAL_PROMPT or k.startswith("head.")]
        assert local and all(torch.equal(a[k], b[k]) for k in a)
        assert sorted(p.name for p in (run / "sites" / site).glob("*.safetensors")) == sorted(
            p.name for p in (whole / "sites" / site).glob("*.safetensors")
        )


@pytest.mark.parametrize("fusion", ["concat", "global"])
def test_ablations_run(i2b2_corpus, tmp_path, fusion):
    result = run_cli(
        "train",
        *ARGS[:-4],
        "--rounds",
        "1",
        "--threads",
        "1",
        "--prompt-fusion",
        fusion,
        "--data",
        str(i2b2_corpus),
        "--out",
        str(tmp_path / fusion),
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / fusion / "config.json").read_text())
    assert config["strategy_options"]["prompt_fusion"] == fusion
