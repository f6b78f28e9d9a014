"""Nothing leaked, nothing lost: protected text never outlives a process
outside the folders the user named, whatever ends it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import CANARY
from .test_cli import run_cli


def _holding(root: Path, needle: bytes) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(path)
        except OSError:
            continue
    return found


def _clinfed(args: list[str], home: Path, tmp: Path, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "clinfed"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_no_note_text_is_left_in_tmp_or_home_after_a_signal(mimic_corpus, tmp_path, signum):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    train = ["train", "--task", "mimic3", "--data", str(mimic_corpus), "--model", "tiny",
             "--rounds", "5000", "--max-length", "32", "--max-chunks", "2", "--threads", "1",
             "--out", str(tmp_path / "run")]  # fmt: skip
    said = tmp_path / "stderr.txt"
    with said.open("wb") as stderr:
        process = _clinfed(train, home, tmp, stderr)
    try:
        deadline = time.monotonic() + 120
        # Wait until tokenized notes are on disk in the scratch folder.
        while time.monotonic() < deadline and process.poll() is None:
            if _holding(tmp, CANARY.encode()):
                break
            time.sleep(0.2)
        assert process.poll() is None, "the run ended before it could be stopped"
        assert _holding(tmp, CANARY.encode())  # the canary really is in what was written
    except BaseException:
        process.kill()  # a 5,000-round run must not outlive a failed test
        process.wait()
        raise
    process.send_signal(signum)
    code = process.wait(timeout=60)
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM  # a clean exit, its scratch folder removed
        # Said as on Ctrl-C: what is kept and the command that resumes it.
        words = said.read_text()
        assert "terminated: the rounds committed so far are kept" in words, words
        assert f"--out {tmp_path / 'run'} --resume" in words
    else:
        assert code == -signal.SIGKILL
        # The next command cleans up after the killed one.
        nxt = _clinfed(["privacy", "epsilon", "--sample-rate", "0.1", "--noise-multiplier",
                        "1", "--steps", "10", "--delta", "1e-5"], home, tmp)  # fmt: skip
        assert nxt.wait(timeout=120) == 0
    assert _holding(tmp, CANARY.encode()) == []
    assert _holding(home, CANARY.encode()) == []
    assert not list(tmp.glob("clinfed-scratch-*"))


def test_data_check_leaves_no_arrow_cache_in_home(mimic_corpus, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    check = _clinfed(["data", "check", "--task", "mimic3", str(mimic_corpus)], home, tmp)
    assert check.wait(timeout=300) == 0
    assert not (home / ".cache" / "huggingface" / "datasets").exists()
    assert _holding(home, CANARY.encode()) == [] and _holding(tmp, CANARY.encode()) == []


TRAIN = ["train", "--task", "i2b2", "--strategy", "fedavg", "--model", "tiny", "--rounds", "2",
         "--max-length", "32", "--threads", "1"]  # fmt: skip


def _hold_lock(path: Path) -> subprocess.Popen:
    holder = (
        "import fcntl, os, sys, time; "
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", holder, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_writer_of_a_run_folder_is_refused(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    args = [*TRAIN, "--data", str(i2b2_corpus), "--out", str(run)]
    assert run_cli(*args).returncode == 0
    # another process is resuming this run; another is starting a new one in "new"
    (tmp_path / "new").mkdir()
    holders = [_hold_lock(run / ".clinfed.lock"), _hold_lock(tmp_path / "new" / ".clinfed.lock")]
    try:
        before = (run / "metrics.jsonl").read_bytes()
        resumed = run_cli(*args, "--resume")
        assert resumed.returncode == 2 and "another clinfed process" in resumed.stderr
        assert (run / "metrics.jsonl").read_bytes() == before
        racing = run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(tmp_path / "new"))
        assert racing.returncode == 2 and "another clinfed process" in racing.stderr
        assert [p.name for p in (tmp_path / "new").iterdir()] == [".clinfed.lock"]
        fresh = run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(tmp_path / "free"))
        assert fresh.returncode == 0  # other folders are free
    finally:
        for process in holders:
            process.kill()
            process.wait()


def test_a_run_that_died_before_its_first_commit_starts_over_on_resume(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    args = [*TRAIN, "--data", str(i2b2_corpus), "--out", str(run)]
    assert run_cli(*args).returncode == 0
    # What a kill before round 1 committed leaves: no state.json, a partial
    # metrics.jsonl, a write that never finished.
    (run / "state.json").unlink()
    (run / "summary.json").unlink()
    for output in ("model", "predictions", "checkpoints"):
        shutil.rmtree(run / output)  # written only at a commit or at the end
    records = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(records[0] + "\n")
    (run / ".summary.json.12345.tmp").write_text("half")
    again = run_cli(*args)
    assert again.returncode == 2 and "--resume starts it over" in again.stderr
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    rounds = [json.loads(r)["round"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds.count(1) == len([r for r in records if json.loads(r)["round"] == 1])
    assert not list(run.glob(".*.tmp"))


def test_resume_accepts_the_same_folder_named_by_another_path(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    assert run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(run)).returncode == 0
    (tmp_path / "elsewhere").mkdir()
    other_data = Path(os.path.relpath(i2b2_corpus, Path.cwd()))
    other_run = tmp_path / "elsewhere" / ".." / "run"
    resumed = run_cli(*TRAIN, "--data", str(other_data), "--out", str(other_run), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    changed = run_cli(*TRAIN[:-2], "--threads", "2", "--data", str(i2b2_corpus),
                      "--out", str(run), "--resume")  # fmt: skip
    # another thread count is this machine's to choose (a run moved to other
    # cores resumes), but the sums run in another order: said, not refused
    assert changed.returncode == 0, changed.stderr
    assert "threads was 1, now 2; the rounds from here are not bit-identical" in changed.stderr
    again = run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(run), "--resume")
    assert again.returncode == 0 and "bit-identical" not in again.stderr


def test_a_cache_hit_reports_the_same_problems_as_the_read_that_made_it(mimic_corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(mimic_corpus, data)
    notes = data / "site1" / "NOTEEVENTS.csv"
    text = notes.read_text()
    notes.write_text(text.replace('"100001","1001","100001"', '"100001","1001","x100001"', 1))
    args = ["train", "--task", "mimic3", "--data", str(data), "--model", "tiny",
            "--max-length", "32", "--max-chunks", "2", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    first = run_cli(*args, "--out", str(tmp_path / "a"))
    second = run_cli(*args, "--out", str(tmp_path / "b"))  # the read is cached now
    assert first.returncode == second.returncode == 2
    assert "NOTEEVENTS.csv:2" in first.stderr and "HADM_ID" in first.stderr
    assert first.stderr == second.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["privacy", "epsilon", "--sample-rate", "0.1", "--noise-multiplier", "inf",
         "--steps", "10", "--delta", "1e-5"],
        ["privacy", "noise", "--target-epsilon", "inf", "--sample-rate", "0.1",
         "--steps", "10", "--delta", "1e-5"],
        ["privacy", "epsilon", "--sample-rate", "nan", "--noise-multiplier", "1",
         "--steps", "10", "--delta", "1e-5"],
        ["train", "--lr", "inf"],
        ["train", "--head-lr", "nan"],
        ["train", "--seed", "-1"],
        ["train", "--strategy", "fedprox", "--mu", "nan"],
        ["train", "--target-epsilon", "1", "--max-grad-norm", "inf"],
        ["train", "--noise-multiplier", "inf"],
        ["train", "--config", "ROUNDS_FLOAT"],
        ["train", "--config", "ROUNDS_BOOL"],
    ],
)  # fmt: skip
def test_non_finite_or_mistyped_settings_exit_2_before_anything_is_written(
    i2b2_corpus, tmp_path, args
):
    configs = {"ROUNDS_FLOAT": "rounds = 1.5\n", "ROUNDS_BOOL": "rounds = true\n"}
    args = list(args)
    for i, value in enumerate(args):
        if value in configs:
            path = tmp_path / "c.toml"
            path.write_text(configs[value])
            args[i] = str(path)
    if args[0] == "train":
        args += ["--task", "i2b2", "--model", "tiny", "--data", str(i2b2_corpus),
                 "--out", str(tmp_path / "run")]  # fmt: skip
    result = run_cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error:") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def _i2b2_copy(i2b2_corpus: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(i2b2_corpus, data)
    return data


def _check_run(data: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("train", "--task", "i2b2", "--model", "tiny", "--rounds", "1",
                   "--max-length", "32", "--threads", "1", "--data", str(data),
                   "--out", str(tmp_path / "run"), *extra)  # fmt: skip


@pytest.mark.parametrize("damage", ["dangling", "loop", "fifo", "no_con"])
def test_bad_i2b2_files_are_named_never_skipped_or_waited_on(i2b2_corpus, tmp_path, damage):
    data = _i2b2_copy(i2b2_corpus, tmp_path)
    txt = data / "train" / "beth" / "txt"
    bad = txt / "x.txt"
    if damage == "dangling":
        bad.symlink_to(tmp_path / "nowhere.txt")
    elif damage == "loop":
        bad.symlink_to(bad)
    elif damage == "fifo":
        os.mkfifo(bad)
    else:
        bad = next(txt.glob("*.txt"))
        (data / "train" / "beth" / "concept" / f"{bad.stem}.con").unlink()
    result = _check_run(data, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(bad) in result.stderr
    assert not (tmp_path / "run").exists()
    if damage == "no_con":  # with --on-error skip: left out, and said so
        skipped = _check_run(data, tmp_path, "--on-error", "skip")
        assert skipped.returncode == 0 and "no .con file" in skipped.stderr + skipped.stdout


def test_a_byte_order_mark_is_accepted_and_skip_leaves_overlapping_concepts_out(
    i2b2_corpus, tmp_path
):
    from clinfed.core.errors import ProblemLog
    from clinfed.tasks.i2b2.format import read_corpus

    data = _i2b2_copy(i2b2_corpus, tmp_path)
    folder = data / "train" / "beth"
    note = sorted((folder / "txt").glob("*.txt"))[0]
    con = folder / "concept" / f"{note.stem}.con"
    note.write_bytes(b"\xef\xbb\xbf" + note.read_bytes())
    first = con.read_text().splitlines()[0]
    con.write_text(con.read_text() + first + "\n")  # the same concept twice
    strict = ProblemLog()
    with pytest.raises(Exception, match="repeats the concept"):
        read_corpus(folder, strict)
    # named by the line of the .con file that repeats it
    repeat = len(con.read_text().splitlines())
    assert any(str(p).startswith(f"{con}:{repeat}: concept at") for p in strict.problems)
    skip = ProblemLog("skip")
    docs = read_corpus(folder, skip)
    doc = next(d for d in docs if d.doc_id == note.stem)
    assert len(doc.concepts) == len(con.read_text().splitlines()) - 1  # the repeat left out
    assert [str(p) for p in skip.problems] == [
        p for p in map(str, skip.problems) if "left out" in p
    ]
    assert "\ufeff" not in doc.lines[0][0]


@pytest.mark.parametrize("damage", ["not_gzip", "truncated_gzip", "big_id", "split_bytes"])
def test_bad_mimic3_files_exit_2_with_the_file_and_line(mimic_corpus, tmp_path, damage):
    import gzip as gz

    data = tmp_path / "data"
    shutil.copytree(mimic_corpus, data)
    site = data / "site1"
    notes = site / "NOTEEVENTS.csv"
    if damage in ("not_gzip", "truncated_gzip"):
        packed = gz.compress(notes.read_bytes())
        notes.unlink()
        target = site / "NOTEEVENTS.csv.gz"
        target.write_bytes(b"plain text" if damage == "not_gzip" else packed[: len(packed) // 2])
        named = target
    elif damage == "big_id":
        text = notes.read_text()
        notes.write_text(text.replace('"100001","1001","100001"', '"100001","1001",'
                                      '"12345678901234567890123"', 1))  # fmt: skip
        named = notes
    else:
        (site / "train_50_hadm_ids.csv").write_bytes(b"100001\n\xff\xfe\n")
        named = site / "train_50_hadm_ids.csv"
    result = run_cli("train", "--task", "mimic3", "--model", "tiny", "--data", str(data),
                     "--out", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(named) in result.stderr
    assert CANARY not in result.stderr


@pytest.fixture(scope="module")
def finished_run(i2b2_corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = run_cli(*TRAIN[:-6], "--rounds", "1", "--max-length", "32", "--threads", "1",
                     "--data", str(i2b2_corpus), "--out", str(run))  # fmt: skip
    assert result.returncode == 0, result.stderr
    return run


def test_score_needs_a_prediction_for_every_gold_document(i2b2_corpus, finished_run, tmp_path):
    predictions = tmp_path / "pred"
    shutil.copytree(finished_run / "predictions", predictions)
    gone = sorted(predictions.rglob("*.con"))[0]
    gone.unlink()
    args = ["score", "--task", "i2b2", "--gold", str(i2b2_corpus / "test"),
            "--pred", str(predictions)]  # fmt: skip
    result = run_cli(*args)
    assert result.returncode == 2 and f"no prediction ({gone.stem}.con)" in result.stderr


@pytest.mark.parametrize("damage", ["truncated", "missing", "model_json"])
def test_a_damaged_run_folder_is_named_by_evaluate_predict_and_audit(
    i2b2_corpus, finished_run, tmp_path, damage
):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    weights = run / "model" / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing":
        weights.unlink()
    else:
        (run / "model" / "model.json").write_text("{not json")
    for args in (
        ["evaluate", str(run), "--data", str(i2b2_corpus / "test")],
        ["predict", str(run), "--data", str(i2b2_corpus / "test"), "--out", str(tmp_path / "p")],
    ):
        result = run_cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, args
        assert str(run / "model") in result.stderr
    assert not (tmp_path / "p").exists()


def test_a_full_disk_at_a_checkpoint_exits_2_and_keeps_the_last_commit(
    i2b2_corpus, tmp_path, monkeypatch
):
    import errno

    from clinfed.federated import state

    run = tmp_path / "run"
    args = [*TRAIN, "--data", str(i2b2_corpus), "--out", str(run)]
    save = state.save_tensors
    calls = []

    def full_disk_in_round_two(path, tensors):
        calls.append(path)
        if "round-0002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(path, tensors)

    monkeypatch.setattr(state, "save_tensors", full_disk_in_round_two)
    result = run_cli(*args)
    assert result.returncode == 2 and "No space left on device" in result.stderr
    assert json.loads((run / "state.json").read_text())["round"] == 1  # round 1 intact
    monkeypatch.setattr(state, "save_tensors", save)
    assert run_cli(*args, "--resume").returncode == 0  # and the run goes on from it


def test_a_sweep_into_a_file_is_refused(i2b2_corpus, tmp_path):
    (tmp_path / "file").write_text("mine")
    result = run_cli("sweep", "--task", "i2b2", "--data", str(i2b2_corpus),
                     "--out", str(tmp_path / "file"), "--epsilons", "inf")  # fmt: skip
    assert result.returncode == 2 and "not a sweep folder" in result.stderr
    assert (tmp_path / "file").read_text() == "mine"


def test_linked_site_folders_are_read_and_a_link_loop_ends(i2b2_corpus, tmp_path):
    from clinfed.core.errors import ProblemLog
    from clinfed.tasks.i2b2.format import read_corpus

    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    real = tmp_path / "elsewhere" / "beth"
    shutil.copytree(i2b2_corpus / "train" / "beth", real)
    (data / "train" / "beth").symlink_to(real)  # a linked site folder is not dropped
    (real / "txt" / "again").symlink_to(real)  # a loop
    docs = read_corpus(data / "train", ProblemLog())
    assert len(docs) == len(list((real / "txt").glob("*.txt")))


def test_start_up_failures_exit_2_and_leave_nothing(mimic_corpus, i2b2_corpus, tmp_path):
    (tmp_path / "file").write_text("mine")
    unwritable = run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(tmp_path / "file" / "r"))
    assert unwritable.returncode == 2 and "Traceback" not in unwritable.stderr
    header_only = tmp_path / "mimic"
    header_only.mkdir()
    for name in ("NOTEEVENTS.csv", "DIAGNOSES_ICD.csv"):
        lines = (mimic_corpus / "site1" / name).read_text().splitlines()
        (header_only / name).write_text(lines[0] + "\n")
    empty = run_cli("train", "--task", "mimic3", "--model", "tiny", "--data", str(header_only),
                    "--out", str(tmp_path / "run"))  # fmt: skip
    assert empty.returncode == 2 and "NOTEEVENTS.csv: no discharge summary" in empty.stderr
    assert not (tmp_path / "run").exists()
    audit = run_cli("audit", str(tmp_path), "--max-examples", "-5")
    assert audit.returncode == 2 and "Traceback" not in audit.stderr


def test_checkpoints_are_fsynced_before_the_commit_names_them(i2b2_corpus, tmp_path, monkeypatch):
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd):
        try:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    run = tmp_path / "run"
    assert run_cli(*TRAIN, "--data", str(i2b2_corpus), "--out", str(run)).returncode == 0
    for round_number in (1, 2):
        weights = next(
            i for i, p in enumerate(synced) if f"round-{round_number:04d}.safetensors" in p
        )
        commits = [i for i, p in enumerate(synced) if Path(p).name.startswith(".state.json")]
        assert any(weights < c for c in commits)
        # the commit of this round comes after its checkpoint's fsync
        assert commits[round_number - 1] > weights


def test_library_use_leaves_no_arrow_cache_behind(mimic_corpus, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    code = (
        "import sys; from clinfed.core.errors import ProblemLog; "
        "from clinfed.tasks.mimic3.adapter import Mimic3Task; "
        "corpus = Mimic3Task(top_k=0).load(sys.argv[1], ProblemLog()); "
        "print(len(corpus.train))"
    )
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp))
    done = subprocess.run([sys.executable, "-c", code, str(mimic_corpus)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0
    assert not (home / ".cache" / "huggingface" / "datasets").exists()
    assert _holding(tmp, CANARY.encode()) == [] and not list(tmp.glob("clinfed-scratch-*"))


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch):
    import errno

    from clinfed.core.runs import append_jsonl, atomic_write_json

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for write, path in ((atomic_write_json, tmp_path / "a.json"),
                        (append_jsonl, tmp_path / "b.jsonl")):  # fmt: skip
        with pytest.raises(OSError) as raised:
            write(path, {"x": 1})
        assert raised.value.filename == str(path) and raised.value.errno == errno.ENOSPC


def test_a_folder_that_cannot_be_written_is_one_error_line(i2b2_corpus, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from .test_cli import TINY_FEDERATED, run_cli

    out = tmp_path / "locked" / "run"
    original = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == out or out in self.parents or self == out.parent:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                     "--data", str(i2b2_corpus), "--out", str(out))  # fmt: skip
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Permission denied" in errors[0], result.stderr
