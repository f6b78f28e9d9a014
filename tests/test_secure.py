"""Secure aggregation: the server's sum equals plain aggregation, the server
never holds one site's upload, dropouts up to the threshold, and the
checks by which a site refuses a server that would unmask it alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import read_jsonl
from clinfed.federated import secure
from clinfed.federated.engine import Deployment, RoundEngine
from clinfed.federated.messages import Message, ReleasedAsReplies, Reply
from clinfed.federated.secure_summation import SecureRound, SecureSummation
from clinfed.federated.strategies import get_strategy

NAMES = ["encoder.layer.0.attention.self.query.weight", "head.weight", "head.bias"]
SHAPES = {NAMES[0]: (4, 3), NAMES[1]: (2, 4), NAMES[2]: (2,)}


class CountsTask:
    def metrics_from_counts(self, counts):
        hits, total = counts["hits"]
        return {"f1": hits / total if total else 0.0}


def upload_of(site: str, round_number: int, names=NAMES) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(hash((site, round_number)) % 2**31)
    return {n: torch.randn(SHAPES[n], generator=generator) * 3 for n in names}


class SecureSites(ReleasedAsReplies):
    """Sites in this process that keep real secrets in their own folders;
    ``fail(site, message)`` scripts a dropout (a reason) or None."""

    def __init__(
        self, root: Path, examples: dict[str, int], fail=None, names=None, plain=(), keyless=()
    ):
        self.root, self.examples = root, examples
        self.plain, self.keyless = set(plain), set(keyless)
        self.fail = fail or (lambda site, message: None)
        self.names = names or {}
        self.seen: list[tuple[str, Message, Reply]] = []

    def addresses(self):
        return sorted(self.examples)

    def handle(self, site: str, message: Message) -> Reply:
        folder = self.root / site
        if message.kind == "secure":
            tensors, part = secure.site_stage(folder, message.round, message.secure)
            return Reply(site=site, upload=tensors, secure=part)
        evaluation = {"counts": {"": {"hits": [1, 2]}}, "examples": 2, "seconds": 0.0}
        if message.kind == "evaluate":
            return Reply(site=site, evaluation=evaluation)
        upload = upload_of(site, message.round, self.names.get(site, NAMES))
        record = {
            "round": message.round,
            "site": site,
            "examples": self.examples[site],
            "bytes_up": 1,
        }
        part = None
        if site in self.plain:  # ignores the request: its upload goes in the clear
            pass
        elif site in self.keyless and message.secure is not None:
            part, upload = {"names": list(upload)}, {}
        elif message.secure is not None:
            part = secure.hold_upload(folder, site, message.round, upload, self.examples[site])
            upload = {}
        evaluated = evaluation if message.evaluate else None
        return Reply(site=site, upload=upload, record=record, evaluation=evaluated, secure=part)

    def exchange(self, messages, timeout):
        for address in sorted(messages):
            message = messages[address]
            why = self.fail(address, message)
            if why is not None:
                yield address, why
                continue
            try:
                reply = self.handle(address, message)
            except ClinfedError as exc:
                yield address, f"refused: {exc}"
                continue
            self.seen.append((address, message, reply))
            yield address, reply


def plain_mean(examples, round_number=1, names=None):
    names = names or {}
    sums, weights = {}, {}
    for site, count in examples.items():
        for name, value in upload_of(site, round_number, names.get(site, NAMES)).items():
            sums[name] = sums.get(name, 0) + value.double() * count
            weights[name] = weights.get(name, 0) + count
    return {n: (sums[n] / weights[n]).float() for n in sums}


def engine(out: Path, secure_threshold=0.5, rounds=1):
    out.mkdir(parents=True, exist_ok=True)
    return RoundEngine(
        CountsTask(),
        get_strategy("fedavg"),
        {n: torch.zeros(SHAPES[n]) for n in NAMES},
        NAMES,
        out,
        rounds,
        deployment=Deployment(wait_for_sites=0.0, round_retries=0),
        summation=SecureSummation(secure_threshold),
    )


def test_the_secure_sum_equals_plain_aggregation_and_no_upload_reaches_the_server(tmp_path):
    examples = {"a": 10, "b": 30, "c": 7}
    sites = SecureSites(tmp_path / "sites", examples)
    run = engine(tmp_path / "run")
    run.run(sites)
    expected = plain_mean(examples)
    for name in NAMES:
        assert torch.allclose(run.global_state[name], expected[name], atol=1e-6), name
    # Everything the server received, stage by stage: keys, ciphertext,
    # masked integers. No tensor equals (or is close to) a site's upload.
    plain = {s: upload_of(s, 1) for s in examples}
    received = [t for _, _, reply in sites.seen for t in reply.upload.values()]
    assert received and all(t.dtype == torch.int64 for t in received)
    for site_upload in plain.values():
        for value in site_upload.values():
            for tensor in received:
                if tensor.shape == value.shape:
                    scaled = tensor.double() / secure.SCALE
                    assert not torch.allclose(scaled / examples["a"], value.double(), atol=1.0)
    # Nothing in the run folder holds a site's upload: its float32 bytes
    # appear in no file.
    needles = [v.numpy().tobytes()[:32] for u in plain.values() for v in u.values()]
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(n in data for n in needles), path
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "bytes_up" in r]
    assert all(r["secure"] for r in records) and len(records) == 3
    # The masked input is 8-byte fixed point: it is what bytes_up counts.
    assert all(r["bytes_up"] > 8 * 22 for r in records)
    # Each site answered once and kept no secret afterwards.
    assert not any((tmp_path / "sites" / s / "secure").exists() for s in examples)


def test_a_site_that_drops_out_after_sharing_is_left_out_of_an_exact_mean(tmp_path):
    examples = {"a": 10, "b": 30, "c": 7, "d": 3}

    def fail(site, message):
        if site == "c" and message.kind == "secure" and message.secure["stage"] == "mask":
            return "no reply within 5 s"
        return None

    sites = SecureSites(tmp_path / "sites", examples, fail)
    run = engine(tmp_path / "run")
    run.run(sites)
    expected = plain_mean({s: n for s, n in examples.items() if s != "c"})
    for name in NAMES:
        assert torch.allclose(run.global_state[name], expected[name], atol=1e-6), name
    records = {r["site"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "site" in r}
    assert records["c"]["secure"] is False and "mask" in records["c"]["secure_dropped"]
    # Its pairwise masks were removed through its key's shares; its own
    # self-mask seed was never asked for.
    unmask = [m.secure for _, m, _ in sites.seen if (m.secure or {}).get("stage") == "unmask"]
    assert unmask and all(m["dropped"] == [3] for m in unmask)
    # Its copy holds its own training, which the sum left out: the whole
    # model next time, not a delta on top of it.
    assert "c" not in run.holds and run.holds["a"] == 0


def test_too_many_dropouts_lose_the_round_and_the_run_stops(tmp_path):
    examples = {"a": 10, "b": 30, "c": 7}

    def fail(site, message):
        if site != "a" and message.kind == "secure" and message.secure["stage"] == "mask":
            return "no reply"
        return None

    run = engine(tmp_path / "run")
    summary = run.run(SecureSites(tmp_path / "sites", examples, fail))
    assert "secure aggregation" in summary["stopped"]
    assert torch.equal(run.global_state[NAMES[0]], torch.zeros(SHAPES[NAMES[0]]))


def test_a_lost_secure_sum_is_not_committed_even_if_a_site_replied_in_the_clear(tmp_path):
    # c ignores the request and uploads in the clear; a and b drop out at
    # the mask stage: the secure sum is lost, so nothing of the round is
    # applied, though one "trained" reply would meet --min-sites.
    examples = {"a": 10, "b": 30, "c": 7}

    def fail(site, message):
        if message.kind == "secure" and message.secure["stage"] == "mask":
            return "no reply"
        return None

    run = engine(tmp_path / "run")
    summary = run.run(SecureSites(tmp_path / "sites", examples, fail, plain={"c"}))
    assert "secure aggregation" in summary["stopped"]
    assert torch.equal(run.global_state[NAMES[0]], torch.zeros(SHAPES[NAMES[0]]))


def test_a_training_reply_without_its_keys_is_rejected_by_name(tmp_path):
    examples = {"a": 10, "b": 30, "c": 7}
    run = engine(tmp_path / "run")
    run.run(SecureSites(tmp_path / "sites", examples, keyless={"c"}))
    records = {r["site"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
               if r.get("round") == 1 and "site" in r}  # fmt: skip
    assert "public keys" in records["c"]["rejected"]
    assert "rejected" not in records["a"] and "rejected" not in records["b"]


def test_sites_sending_different_names_get_per_name_weights(tmp_path):
    examples = {"a": 10, "b": 30, "c": 5}
    names = {"a": NAMES, "b": NAMES[1:], "c": [NAMES[0], NAMES[2]]}
    run = engine(tmp_path / "run")
    run.run(SecureSites(tmp_path / "sites", examples, names=names))
    expected = plain_mean(examples, names=names)
    for name in NAMES:
        assert torch.allclose(run.global_state[name], expected[name], atol=1e-6), name


def _shared_group(tmp_path, count=3):
    """Sites through stages 1-2 by hand: the server's session and folders."""
    session = SecureRound(SHAPES, frozenset(NAMES), 0.5)
    folders = {}
    for site in "abcde"[:count]:
        folders[site] = tmp_path / site
        part = secure.hold_upload(folders[site], site, 1, upload_of(site, 1), 5)
        assert session.join(site, part) is None
    requests = session.share_requests()
    for site, request in requests.items():
        _, part = secure.site_stage(folders[site], 1, request)
        assert session.take_shares(site, part) is None
    return session, folders


def test_a_site_refuses_a_threshold_below_a_majority(tmp_path):
    session = SecureRound(SHAPES, frozenset(NAMES), 0.5)
    folders = {s: tmp_path / s for s in "abcd"}
    for site, folder in folders.items():
        session.join(site, secure.hold_upload(folder, site, 1, upload_of(site, 1), 5))
    request = session.share_requests()["a"] | {"threshold": 2}  # 2 of 4: not a majority
    with pytest.raises(ClinfedError, match="threshold 2 for 4 sites refused"):
        secure.site_stage(folders["a"], 1, request)


def test_a_site_never_reveals_both_secrets_of_one_site(tmp_path):
    session, folders = _shared_group(tmp_path)
    for site, request in session.mask_requests().items():
        tensors, _ = secure.site_stage(folders[site], 1, request)
        session.add_masked(site, tensors)
    # A server that calls "b" both a survivor and a dropout: refused.
    with pytest.raises(ClinfedError, match="do not split"):
        secure.site_stage(
            folders["a"], 1, {"stage": "unmask", "survivors": [1, 2, 3], "dropped": [2]}
        )
    # Told the truth, it answers once; asked again (to tell another story), it
    # holds nothing any more.
    request = session.unmask_requests()["a"]
    secure.site_stage(folders["a"], 1, request)
    with pytest.raises(ClinfedError, match="no secrets"):
        secure.site_stage(folders["a"], 1, request | {"survivors": [1, 3], "dropped": [2]})


def test_a_site_does_not_mask_for_a_group_below_the_threshold(tmp_path):
    session, folders = _shared_group(tmp_path)
    request = session.mask_requests()["a"]
    alone = request | {"members": [1], "shares": {}}
    with pytest.raises(ClinfedError, match="below the threshold"):
        secure.site_stage(folders["a"], 1, alone)


def test_a_tampered_share_is_refused(tmp_path):
    session, folders = _shared_group(tmp_path)
    request = session.mask_requests()["a"]
    forged = dict(request["shares"])
    forged["2"] = request["shares"]["3"]  # c's share for a, relayed as b's
    with pytest.raises(ClinfedError, match="does not decrypt|misaddressed"):
        secure.site_stage(folders["a"], 1, request | {"shares": forged})


def test_secrets_stay_in_the_site_folder_readable_by_the_site_alone(tmp_path):
    folder = tmp_path / "site"
    secure.hold_upload(folder, "a", 1, upload_of("a", 1), 5)
    files = list((folder / "secure").iterdir())
    assert len(files) == 2
    assert os.stat(folder / "secure").st_mode & 0o777 == 0o700
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    secrets = json.loads((folder / "secure" / "r0001.json").read_text())
    assert "PRIVATE KEY" in secure._unb64(secrets["private"]["mask"]).decode()
    # A new round drops the last one's secrets.
    secure.hold_upload(folder, "a", 2, upload_of("a", 2), 5)
    assert sorted(p.name for p in (folder / "secure").iterdir()) == [
        "r0002.json",
        "r0002.safetensors",
    ]


def test_masks_are_keyed_streams_not_a_32_bit_seed():
    import numpy as np

    one = [np.zeros(8, np.uint64)]
    two = [np.zeros(8, np.uint64)]
    key = bytes(range(32))
    secure.add_mask(one, key, +1)
    # Keys equal in every 32-bit word's XOR (what a folded seed keeps) give
    # other streams.
    other = bytes(range(4, 32)) + bytes(range(4))
    secure.add_mask(two, other, +1)
    assert not np.array_equal(one[0], two[0])
    secure.add_mask(one, key, -1)
    assert not one[0].any()


def test_a_site_called_a_dropout_after_sending_stays_hidden_by_its_self_mask(tmp_path):
    """A server that received c's masked input and then claims c dropped
    out gets c's mask key, removes c's pairwise masks, and still sees noise:
    c's self-mask seed is shared only for survivors."""
    import numpy as np
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    session, folders = _shared_group(tmp_path, count=5)
    masked = {}
    for site, request in session.mask_requests().items():
        masked[site], _ = secure.site_stage(folders[site], 1, request)
    lie = {"stage": "unmask", "survivors": [1, 2, 4, 5], "dropped": [3]}
    answers = [secure.site_stage(folders[s], 1, lie)[1]["shares"] for s in "abd"]
    private = bytes_to_private_key(combine_shares([secure._unb64(a["3"]) for a in answers]))
    vectors = [masked["c"][n].numpy().ravel().view(np.uint64).copy() for n in NAMES]
    vectors.append(masked["c"][secure.WEIGHTS].numpy().view(np.uint64).copy())
    for other in (1, 2, 4, 5):
        public = bytes_to_public_key(
            secure._unb64(session.members["abcde"[other - 1]].keys["mask"])
        )
        key = secure._mask_key(generate_shared_key(private, public))
        secure.add_mask(vectors, key, -1 if 3 < other else +1)
    truth = upload_of("c", 1)
    recovered = vectors[0].view(np.int64).astype(np.float64) / (5 * secure.SCALE)
    assert not np.allclose(recovered, truth[NAMES[0]].numpy().ravel(), atol=1.0)
    assert vectors[-1].view(np.int64).tolist() != [5, 5, 5]


@pytest.mark.parametrize(
    "strategy, options",
    [("fedavg", {}), ("safl", {"top_layers": 1, "selection": "global"})],
)
def test_an_in_process_run_ends_with_the_weights_of_plain_aggregation(
    i2b2_corpus, tmp_path, strategy, options, traffic
):
    from safetensors.torch import load_file

    from clinfed.runners.pipeline import RunConfig, run_training

    base = {"task": "i2b2", "strategy": strategy, "model": "tiny", "max_length": 32}
    base |= {"rounds": 2, "batch_size": 8, "threads": 1, "strategy_options": options}
    runs, first = {}, 0
    for label, secure_on in (("plain", False), ("secure", True)):
        first = len(traffic.messages)
        out = tmp_path / label
        config = RunConfig.of(data=str(i2b2_corpus), out=str(out), **base)
        run_training(config.replace(secure_aggregation=secure_on))
        runs[label] = load_file(str(out / "model" / "model.safetensors"))
    worst = max((runs["plain"][k] - runs["secure"][k]).abs().max().item() for k in runs["plain"])
    assert worst <= 1e-5
    # What the secure run's sites sent up: nothing in a training reply, then
    # masked 64-bit integers only.
    secure_messages = traffic.messages[first:]
    assert all(not m["up"] for m in secure_messages if m["kind"] == "train")
    assert any(m["up"] for m in secure_messages if m["kind"] == "secure")


def test_one_training_site_alone_is_never_summed_in_secret(tmp_path):
    # A sum of one is that site's update: no stage runs, the round is lost.
    sites = SecureSites(tmp_path / "sites", {"a": 10})
    run = engine(tmp_path / "run")
    summary = run.run(sites)
    assert "secure aggregation" in summary["stopped"]
    assert not [m for _, m, _ in sites.seen if m.kind == "secure"]
    assert torch.equal(run.global_state[NAMES[0]], torch.zeros(SHAPES[NAMES[0]]))


def test_a_site_masks_only_in_a_group_as_large_as_its_policy_says(tmp_path):
    session = SecureRound(SHAPES, frozenset(NAMES), 0.5)
    folders = {s: tmp_path / s for s in "abc"}
    for site, folder in folders.items():
        session.join(site, secure.hold_upload(folder, site, 1, upload_of(site, 1), 5))
    request = session.share_requests()["a"]
    # The node expects at least 4 sites: a group of 3 keys is refused ...
    with pytest.raises(ClinfedError, match="group of 3 sites refused"):
        secure.site_stage(folders["a"], 1, request, min_group=4)
    # ... a group as large as it expects is served.
    _, part = secure.site_stage(folders["a"], 1, request, min_group=3)
    assert part["shares"]


def test_a_forged_key_and_a_declared_dropout_never_shrink_the_group_below_the_site_s_minimum(
    tmp_path,
):
    # The server joins a key of its own ("f") beside the victim ("a") and one
    # real site ("b"): three keys pass a's minimum group of 3 at the share
    # stage. It then declares b dropped, so that the masked sum of the
    # remaining two, a's update plus its own, would give it a's update.
    session = SecureRound(SHAPES, frozenset(NAMES), 0.5)
    folders = {s: tmp_path / s for s in "abf"}
    for site, folder in folders.items():
        session.join(site, secure.hold_upload(folder, site, 1, upload_of(site, 1), 5))
    for site, request in session.share_requests().items():
        _, part = secure.site_stage(folders[site], 1, request, min_group=3)
        session.take_shares(site, part)
    request = session.mask_requests()["a"]
    index = {site: session.members[site].index for site in "abf"}
    shrunk = request | {
        "members": [index["a"], index["f"]],
        "shares": {k: v for k, v in request["shares"].items() if k == str(index["f"])},
    }
    with pytest.raises(ClinfedError, match="minimum group"):
        secure.site_stage(folders["a"], 1, shrunk)
    # The same at the unmasking: survivors fewer than the minimum are refused.
    tensors, _ = secure.site_stage(folders["a"], 1, request)
    unmask = {"stage": "unmask", "survivors": [index["a"], index["f"]], "dropped": [index["b"]]}
    with pytest.raises(ClinfedError, match="minimum group"):
        secure.site_stage(folders["a"], 1, unmask)
    assert tensors
