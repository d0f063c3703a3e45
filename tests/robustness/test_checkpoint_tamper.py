"""Checkpoints that were damaged or crafted: every byte checked, no path outside the folder.

Two small checkpoints (tiny GPT, ZeRO-2, a client tensor) are saved once, on 2 ranks and on
1 rank. Copies are then damaged one way each and must be refused, with an error naming the
file, by ``load_checkpoint`` (in a 1-rank engine, and in a 2-rank engine for a damaged
rank-1 file: both ranks raise, neither hangs), by ``get_fp32_state_dict_from_checkpoint``
and by ``shardspeed checkpoint to-fp32`` (non-zero exit, one line on stderr):

* one flipped byte at several positions of every rank file (the safetensors length prefix,
  header JSON, tensor data, last byte; the rank JSON; the manifest) and a truncation;
* paths out of the folder: ``latest`` naming ``../`` or an absolute path, ``tag="../x"``,
  an absolute tag, manifest entries with ``../`` (re-sealed, so only the path check can
  catch them), a symlinked tag and a symlinked rank file; ``latest`` that is not UTF-8;
* a DeepSpeed ``.pt`` pickle calling ``os.system``: refused by name, never run.

Issue 20 defects 4-7 (the config defect 8 is in ``test_config_corpus.py``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint
from shardspeed.checkpoint.deepspeed_import import _Unpickler
from shardspeed.checkpoint.integrity import CHECKSUMS, MANIFEST_SHA, seal
from shardspeed.launcher.checkpoint_cmd import main as checkpoint_main
from shardspeed.testing import run_distributed

TAG = "t"


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }


def _engine():
    import shardspeed
    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    engine, *_ = shardspeed.initialize(model=model, config=_config())
    return engine


def _save_rank(save_dir: str) -> None:
    engine = _engine()
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag=TAG, client_state={"ids": torch.arange(5)})


def _load_rank(cases: list[tuple[str, str | None, bool]]) -> list[str | None]:
    """Load each ``(dir, tag, verify)``: None when it loaded, else the error's type and text."""
    from shardspeed.checkpoint import load_checkpoint

    engine = _engine()
    out = []
    for load_dir, tag, verify in cases:
        try:
            if verify:  # the default: verified
                load_checkpoint(engine, load_dir, tag)
            else:
                load_checkpoint(engine, load_dir, tag, verify_checksums=False)
            out.append(None)
        except Exception as err:  # reported to the test
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("saved")
    for world in (2, 1):
        run_distributed(_save_rank, world, str(root / f"w{world}"), timeout=120)
    return {world: root / f"w{world}" for world in (2, 1)}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _positions(path: Path) -> dict[str, int]:
    """Byte offsets to damage in one file, by what they hit."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        header = int.from_bytes(data[:8], "little")
        return {
            "length prefix": 0,
            "header json": 8 + header // 2,
            "tensor data": 8 + header + 5,
            "last byte": len(data) - 1,
        }
    digit = data.index(b'"world_size": ') + len(b'"world_size": ')
    return {"json digit": digit, "json middle": len(data) // 2}


def _flip_cases(saved: dict[int, Path], root: Path) -> list[tuple[Path, str]]:
    """(copy with one flipped byte, name of the damaged file) for every file and position."""
    cases = []
    for world, src in saved.items():
        tag_dir = src / TAG
        names = [f"rank{r:05d}.{ext}" for r in range(world) for ext in ("safetensors", "json")]
        for name in [*names, "manifest.json"]:
            for what, offset in _positions(tag_dir / name).items():
                copy = _copy(src, root / f"w{world}-{name}-{what.replace(' ', '_')}")
                _flip(copy / TAG / name, offset)
                cases.append((copy, name))
    return cases


def _to_fp32(ckpt: Path, out: Path, *extra: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = checkpoint_main(["to-fp32", str(ckpt), str(out), "--safetensors", *extra])
    return rc, capsys.readouterr().err


def _one_line_refusal(rc: int, err: str, *words: str) -> None:
    assert rc != 0, err
    assert err.startswith("shardspeed checkpoint: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


# -- checksums -------------------------------------------------------------------------------
def test_every_flipped_byte_and_truncation_is_detected(saved, tmp_path: Path, capsys) -> None:
    cases = _flip_cases(saved, tmp_path)
    truncated = _copy(saved[2], tmp_path / "truncated")
    path = truncated / TAG / "rank00001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    cases.append((truncated, "rank00001.safetensors"))
    assert len(cases) == 2 * (4 + 2) + 2 + (4 + 2) + 2 + 1

    results = run_distributed(_load_rank, 1, [(str(c), None, True) for c, _ in cases])[0]
    for (ckpt, name), error in zip(cases, results):
        assert error is not None, f"{ckpt.name}: the damaged checkpoint loaded"
        assert name in error and ("corrupt" in error or "format_version" in error), error
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            get_fp32_state_dict_from_checkpoint(ckpt)
        rc, err = _to_fp32(ckpt, tmp_path / "out" / ckpt.name, capsys=capsys)
        _one_line_refusal(rc, err, name)


def test_two_ranks_agree_on_a_damaged_file(saved, tmp_path: Path) -> None:
    """Rank 1 hashes rank00001.*; both ranks raise the same error, neither hangs."""
    copy = _copy(saved[2], tmp_path / "damaged")
    path = copy / TAG / "rank00001.safetensors"
    _flip(path, path.stat().st_size - 1)
    good = run_distributed(_load_rank, 2, [(str(saved[2]), None, True)], timeout=60)
    assert good == [[None], [None]]
    errors = run_distributed(_load_rank, 2, [(str(copy), None, True)], timeout=60)
    for (error,) in errors:
        assert error is not None and "rank00001.safetensors" in error, error
        assert "is corrupt" in error and "Restore it from a copy or load another tag" in error


def test_fast_option_skips_verification_and_good_checkpoints_pass(
    saved, tmp_path: Path, capsys
) -> None:
    copy = _copy(saved[1], tmp_path / "data-flip")
    path = copy / TAG / "rank00000.safetensors"
    _flip(path, path.stat().st_size - 1)  # a weight's last byte: readable, wrong
    results = run_distributed(
        _load_rank,
        1,
        [(str(saved[1]), None, True), (str(saved[2]), None, True), (str(copy), None, False)],
    )[0]
    assert results == [None, None, None]
    assert get_fp32_state_dict_from_checkpoint(copy, verify_checksums=False)
    rc, err = _to_fp32(saved[2], tmp_path / "good", capsys=capsys)
    assert rc == 0 and (tmp_path / "good" / "model.safetensors").is_file(), err
    rc, _ = _to_fp32(copy, tmp_path / "skip", "--no-verify-checksums", capsys=capsys)
    assert rc == 0


def test_checkpoint_without_checksums_loads_with_a_warning(saved, tmp_path: Path) -> None:
    copy = _copy(saved[1], tmp_path / "old")
    manifest_path = copy / TAG / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for key in (CHECKSUMS, MANIFEST_SHA):
        del manifest[key]
    manifest_path.write_text(json.dumps(manifest))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        assert get_fp32_state_dict_from_checkpoint(copy)
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    assert any("has no checksums" in r.getMessage() for r in records)
    # only one of the two fields left: the manifest was damaged, not old
    manifest[CHECKSUMS] = {}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not match its own checksum"):
        get_fp32_state_dict_from_checkpoint(copy)


def test_corrupt_header_without_verification_is_a_clear_one_line_error(
    saved, tmp_path: Path, capsys
) -> None:
    copy = _copy(saved[1], tmp_path / "header")
    path = copy / TAG / "rank00000.safetensors"
    data = bytearray(path.read_bytes())
    data[0:8] = (2**40).to_bytes(8, "little")  # a header length past the end of the file
    path.write_bytes(bytes(data))
    rc, err = _to_fp32(copy, tmp_path / "out", "--no-verify-checksums", capsys=capsys)
    _one_line_refusal(rc, err, "rank00000.safetensors", "truncated or corrupt")
    (error,) = run_distributed(_load_rank, 1, [(str(copy), None, False)])[0]
    assert error is not None and "cannot read checkpoint file" in error, error


# -- paths -----------------------------------------------------------------------------------
def _escape_cases(saved: dict[int, Path], root: Path) -> list[tuple[str, str | None, str]]:
    """(load dir, tag, expected words) for every way out of the folder."""
    other = _copy(saved[2], root / "other")  # a valid checkpoint somewhere else
    cases = []
    for i, latest in enumerate(["../other/t", str(other / TAG)]):
        d = _copy(saved[1], root / f"latest{i}")
        (d / "latest").write_text(latest)
        cases.append((str(d), None, "not a relative path inside"))
    d = _copy(saved[1], root / "utf8")
    (d / "latest").write_bytes(b"\xff\xfe" + TAG.encode())
    cases.append((str(d), None, "not UTF-8"))
    cases.append((str(saved[1]), "../other/t", "not a relative path inside"))
    cases.append((str(saved[1]), str(other / TAG), "not a relative path inside"))
    d = _copy(saved[1], root / "symtag")
    (d / "evil").symlink_to(other / TAG, target_is_directory=True)
    cases.append((str(d), "evil", "outside"))
    d = _copy(saved[1], root / "symfile")
    (d / TAG / "rank00000.safetensors").unlink()
    (d / TAG / "rank00000.safetensors").symlink_to(other / TAG / "rank00000.safetensors")
    cases.append((str(d), None, "outside"))
    # a crafted manifest (re-sealed, consistent checksums) whose entries point at another
    # checkpoint: only the path check can refuse it
    d = _copy(saved[1], root / "entries")
    path = d / TAG / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop(MANIFEST_SHA, None)
    text = json.dumps(manifest).replace(
        '"rank00000.safetensors"', '"../../other/t/rank00000.safetensors"'
    )
    path.write_text(json.dumps(seal(json.loads(text))))
    cases.append((str(d), None, "../../other/t/rank00000.safetensors"))
    return cases


def test_no_load_path_leaves_the_checkpoint_folder(saved, tmp_path: Path, capsys) -> None:
    cases = _escape_cases(saved, tmp_path)
    loads = [(d, tag, verify) for d, tag, _ in cases for verify in (True, False)]
    results = run_distributed(_load_rank, 1, loads)[0]
    for (d, tag, verify), error in zip(loads, results):
        words = next(w for dd, tt, w in cases if (dd, tt) == (d, tag))
        assert error is not None, f"{d} tag={tag} verify={verify}: loaded"
        assert error.startswith("CheckpointIntegrityError") and words in error, error
    for d, tag, words in cases:
        with pytest.raises(ValueError, match="inside|outside|UTF-8|plain file name") as info:
            get_fp32_state_dict_from_checkpoint(d, tag)
        assert words in str(info.value)
        extra = ["--tag", tag] if tag is not None else []
        rc, err = _to_fp32(Path(d), tmp_path / "out", *extra, capsys=capsys)
        _one_line_refusal(rc, err)


# -- DeepSpeed pickles -----------------------------------------------------------------------
class _Payload:
    """Unpickles to ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_deepspeed_import_refuses_a_code_global(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "pwned"
    tag_dir = tmp_path / "ds" / "global_step1"
    tag_dir.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save(
        {"module": {}, "x": _Payload(f"touch {marker}")}, tag_dir / "mp_rank_00_model_states.pt"
    )
    rc = checkpoint_main(["from-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    _one_line_refusal(rc, err, "system", "mp_rank_00_model_states.pt", "refusing to unpickle")
    assert not marker.exists()
    (tmp_path / "ds" / "latest").write_text("../../etc")
    rc = checkpoint_main(["from-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")])
    _one_line_refusal(rc, capsys.readouterr().err, "not a relative path inside")


def test_deepspeed_import_names_a_truncated_file(tmp_path: Path, capsys) -> None:
    tag_dir = tmp_path / "ds" / "global_step1"
    tag_dir.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    whole = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(64)}}, whole)
    whole.write_bytes(whole.read_bytes()[:100])
    rc = checkpoint_main(["from-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    _one_line_refusal(rc, err, "mp_rank_00_model_states.pt", "truncated or corrupted")


@pytest.mark.parametrize(
    "module, name",
    [
        ("posix", "system"),
        ("builtins", "eval"),
        ("__builtin__", "getattr"),
        ("subprocess", "Popen"),
    ],
)
def test_unpickler_names_the_refused_global(module: str, name: str) -> None:
    data = (
        b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x02\x00\x00\x00idq\x00\x85q\x01Rq\x02."
    )
    with pytest.raises(Exception, match=f"names '[a-z_]+\\.{name}'.*refusing to unpickle"):
        _Unpickler(io.BytesIO(data)).load()


def test_unpickler_reads_deepspeed_data_classes_as_plain_data() -> None:
    # ZeroStageEnum(2), an OrderedDict and a torch.Size, pickled by hand (no DeepSpeed needed)
    data = (
        b"\x80\x02}q\x00(X\x05\x00\x00\x00stageq\x01"
        b"cdeepspeed.runtime.zero.config\nZeroStageEnum\nK\x02\x85Rq\x02"
        b"X\x05\x00\x00\x00shapeq\x03ctorch\nSize\n]q\x04(K\x02K\x03e\x85Rq\x05"
        b"X\x01\x00\x00\x00oq\x06ccollections\nOrderedDict\n)Rq\x07u."
    )
    out = _Unpickler(io.BytesIO(data)).load()
    assert int(out["stage"]) == 2 and out["shape"] == torch.Size([2, 3])
    assert type(out["stage"]).__module__ == "deepspeed.runtime.zero.config"
    assert not isinstance(out["stage"], type) and "deepspeed" not in type(out["o"]).__module__
