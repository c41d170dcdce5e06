"""Checkpoints: atomic save, verified load, device-independent digests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared import checkpoint
from shared.policy import PolicyConfig, init_policy
from shared.tokenizer import TOKENIZER

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size)


def test_round_trip(tmp_path: Path) -> None:
    model = init_policy(CFG, seed=0)
    path = tmp_path / "sub" / "step-3.pt"
    dig = checkpoint.save(path, model, CFG, version="v3", step=3)
    assert dig == checkpoint.digest(model.state_dict())
    assert [p.name for p in path.parent.iterdir()] == ["step-3.pt"]  # no temp file left behind
    ckpt = checkpoint.load(path, "cpu")
    assert (ckpt.version, ckpt.step, ckpt.digest, ckpt.config) == ("v3", 3, dig, CFG)
    assert checkpoint.digest(ckpt.model.state_dict()) == dig
    for key, value in model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[key], value)
    assert not ckpt.model.training


def test_file_is_weights_only_loadable(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    checkpoint.save(path, init_policy(CFG, seed=0), CFG, version="v1", step=1)
    payload = torch.load(path, weights_only=True)
    assert set(payload) >= {"config", "state_dict", "version", "step", "digest"}


def test_digest_stable_and_sensitive() -> None:
    a, b = init_policy(CFG, seed=5), init_policy(CFG, seed=5)
    assert checkpoint.digest(a.state_dict()) == checkpoint.digest(b.state_dict())
    reordered = dict(reversed(list(a.state_dict().items())))
    assert checkpoint.digest(reordered) == checkpoint.digest(a.state_dict())
    with torch.no_grad():
        b.head.weight[0, 0] += 1e-3
    assert checkpoint.digest(a.state_dict()) != checkpoint.digest(b.state_dict())
    # dtype and shape are part of the digest, not just the bytes
    t = torch.zeros(4)
    assert checkpoint.digest({"x": t}) != checkpoint.digest({"x": t.view(2, 2)})
    assert checkpoint.digest({"x": t}) != checkpoint.digest({"x": t.to(torch.int32)})


def test_overwrite_is_atomic_replace(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    checkpoint.save(path, init_policy(CFG, seed=0), CFG, version="v1", step=1)
    d2 = checkpoint.save(path, init_policy(CFG, seed=1), CFG, version="v2", step=2)
    ckpt = checkpoint.load(path)
    assert (ckpt.version, ckpt.digest) == ("v2", d2)
    assert len(list(tmp_path.iterdir())) == 1


def test_tampered_weights_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    checkpoint.save(path, init_policy(CFG, seed=0), CFG, version="v1", step=1)
    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["head.weight"][0, 0] += 1.0
    torch.save(payload, path)
    with pytest.raises(checkpoint.CheckpointError, match="digest mismatch"):
        checkpoint.load(path)


def test_corrupt_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load(bad)
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "absent.pt")
    incomplete = tmp_path / "incomplete.pt"
    torch.save({"version": "v1"}, incomplete)
    with pytest.raises(checkpoint.CheckpointError, match="lacks"):
        checkpoint.load(incomplete)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_digest_equal_across_devices(tmp_path: Path) -> None:
    model = init_policy(CFG, seed=0)
    dig = checkpoint.digest(model.state_dict())
    assert checkpoint.digest(model.to("cuda").state_dict()) == dig
    path = tmp_path / "c.pt"
    assert checkpoint.save(path, model, CFG, version="v1", step=1) == dig
    assert checkpoint.load(path, "cuda").digest == dig
