"""Recording loses nothing when the server stops: Ctrl-C, SIGTERM right after the last answer,
and a killed engine (recovered by the next start on the same directory)."""

import os

import pytest

from vllm_smoe.serving.config import SmoeConfig


def test_a_record_directory_always_records_or_is_refused(tmp_path):
    rec, placement = str(tmp_path / "rec"), str(tmp_path / "p.yaml")
    assert SmoeConfig.from_dict({"record": rec, "placement": placement}).mode == "record"
    assert SmoeConfig.from_dict({"record": rec}).mode == "record"
    with pytest.raises(ValueError, match="mode 'record' applies a placement as well"):
        SmoeConfig.from_dict({"record": rec, "placement": placement, "mode": "place"})
    spec = SmoeConfig.from_dict({"record": rec, "placement": placement, "mode": "speculate", "record_sample": 0.25,
                                 "record_max_mb": 512})
    assert (spec.mode, spec.record_sample, spec.record_max_mb) == ("speculate", 0.25, 512.0)  # records too
    assert SmoeConfig.from_dict(spec.to_dict()) == spec
    assert SmoeConfig.from_dict(SmoeConfig().to_dict()) == SmoeConfig()
    for bad in [{"log_interval": True}, {"log_interval": float("nan")}, {"record_chunk_tokens": True},
                {"record": rec, "record_sample": 0}, {"record": rec, "record_sample": 1.5},
                {"record": rec, "record_sample": True}, {"record": rec, "record_max_mb": -1},
                {"record": rec, "record_max_mb": float("inf")}, {"record_sample": 0.5}]:
        key = next(k for k in bad if k != "record")
        with pytest.raises(ValueError, match=f"field '{key}'"):
            SmoeConfig.from_dict(bad)


def test_sampling_keeps_whole_requests_by_a_stable_share():
    from vllm_smoe.serving.record.recorder import sampled

    ids = [f"cmpl-{i:x}-0" for i in range(20000)]
    for share in (0.1, 0.5):
        kept = [sampled(r, share) for r in ids]
        assert abs(sum(kept) / len(ids) - share) < 0.02
        assert kept == [sampled(r, share) for r in ids]  # the same request, the same answer
    assert all(sampled(r, 1.0) for r in ids[:100])
    assert all(sampled(r, 0.5) for r in ids if sampled(r, 0.1))  # a smaller share keeps a subset


def test_disk_budget_removes_the_oldest_files_first(tmp_path):
    from types import SimpleNamespace

    from vllm_smoe.serving.record.recorder import Recorder

    for i in range(5):
        f = tmp_path / f"trace-dp0-x-{i:05d}.npz"
        f.write_bytes(b"0" * 300_000)
        os.utime(f, (1000 + i, 1000 + i))
    (tmp_path / "notes.npz").write_bytes(b"0" * 900_000)  # not a trace: never counted or removed
    rec = SimpleNamespace(cfg=SimpleNamespace(record=str(tmp_path), record_max_mb=1.0), removed=0)
    Recorder._enforce_budget(rec)
    assert sorted(os.listdir(tmp_path)) == ["notes.npz", "trace-dp0-x-00002.npz", "trace-dp0-x-00003.npz",
                                            "trace-dp0-x-00004.npz"]
    assert rec.removed == 2
    big = tmp_path / "trace-dp0-x-00005.npz"
    big.write_bytes(b"0" * 2_000_000)  # alone over the budget: the file just closed stays, the rest go
    Recorder._enforce_budget(rec, str(big))
    assert sorted(os.listdir(tmp_path)) == ["notes.npz", big.name] and rec.removed == 5
