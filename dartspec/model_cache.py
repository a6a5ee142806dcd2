"""A converted model folder: a GGUF dequantized once into a Hugging Face folder, and its manifest.

The folder is written to a temporary sibling and renamed into place, so a folder at the final path is always
complete. It carries ``dartspec-manifest.json`` with the size and sha256 of every file: :func:`check_sizes` is
cheap enough for every load, :func:`verify_model_cache` checks the hashes too. Which model to convert, and where
its GGUF comes from, is :mod:`dartspec.models`' business.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dartspec import atomic
from dartspec.errors import DartspecError

__all__ = ["MANIFEST_NAME", "check_sizes", "convert_gguf", "sha256", "swap_into_place", "verify_model_cache"]

MANIFEST_NAME = "dartspec-manifest.json"
# Bump when the layout of a converted folder changes, so old caches are rebuilt rather than misread.
MANIFEST_FORMAT = 1
# A leftover temporary folder older than this belongs to a crashed conversion, not a running one
# (the slowest known conversion takes a couple of minutes).
_STALE_TMP_SECONDS = 3 * 3600


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def convert_gguf(
    gguf_path: Path,
    dest: Path,
    *,
    log: Callable[[str], None] = _log_stderr,
    message: str | None = None,
    expect_chat_template: bool = False,
) -> Path:
    """Dequantize ``gguf_path`` into a Hugging Face folder at ``dest`` (fp32 safetensors) and return it.

    The folder is built in a temporary sibling of ``dest`` and renamed into place at the end, with a
    ``dartspec-manifest.json`` recording sizes and hashes of the source and of every written file.
    An existing folder at ``dest`` is replaced.

    Args:
        gguf_path: the GGUF file.
        dest: where the converted folder should end up.
        log: receives ``message`` before the slow part starts.
        message: the progress line; a generic one if None.
        expect_chat_template: fail if the GGUF has no chat template (for known chat models).

    Raises:
        DartspecError: transformers could not read the file, or the chat template was lost.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(dest)
    log(message or f"Converting {gguf_path.name} to safetensors (once)...")
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        with _one_reader_per_file():  # the tensor kinds are read with the conversion's own reader
            template = _dequantize_and_save(gguf_path, tmp)
            kinds = _tensor_kinds(gguf_path)
        if expect_chat_template and not template:
            raise DartspecError(
                f"{gguf_path.name} carries no chat template, but this model needs one: please report it"
            )
        manifest = {
            "dartspec_manifest": MANIFEST_FORMAT,
            "source": {
                "file": gguf_path.name,
                # where the file was: the lean runtime reads the groups that only the file shows (dartspec.kquants)
                "path": str(gguf_path.resolve()),
                "size": gguf_path.stat().st_size,
                "sha256": sha256(gguf_path),
                # which tensor kinds it holds: a file without K-quant blocks need not be read again
                **({"tensor_types": kinds} if kinds is not None else {}),
            },
            "files": {
                f.name: {"size": f.stat().st_size, "sha256": sha256(f)} for f in sorted(tmp.iterdir()) if f.is_file()
            },
            "has_chat_template": bool(template),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if "model.safetensors" not in manifest["files"]:
            raise DartspecError(f"converting {gguf_path.name} wrote no model.safetensors: please report it")
        _write_json_atomic(tmp / MANIFEST_NAME, manifest)
        swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"Converted model saved to {dest} ({time.monotonic() - started:.0f} s)")
    return dest


@contextlib.contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader`` of one file is the same reader. transformers opens a GGUF once for the
    config, once for the model's weights and again for the tokenizer, and each reader parses every metadata key
    (SmolLM2's 49K tokens and merges: ~4 s on 2 cores each time, most of a first run's conversion). The readers
    map the file read-only, so sharing one changes nothing of what is read."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _tensor_kinds(gguf_path: Path) -> list[str] | None:
    """The quantization kinds of the file's tensors (``Q4_K``, ``Q8_0``, ``F32``...), or None where it cannot say."""
    try:
        import gguf

        return sorted({gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(gguf_path).tensors})
    except Exception:  # only a shortcut for a later load: without it the file is read then
        return None


def _dequantize_and_save(gguf_path: Path, out_dir: Path) -> str | None:
    """Load ``gguf_path`` with transformers (dequantizing to fp32) and save it to ``out_dir``.

    Returns the chat template that the saved tokenizer reloads with (None if the GGUF has none).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        with _one_reader_per_file():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DartspecError(
            f"transformers could not load {gguf_path}: {type(exc).__name__}: {first_line} "
            "(check that it is a GGUF of a supported architecture)"
        ) from None

    # The weights are plain fp32 tensors now, but transformers still marks the model as
    # GGUF-quantized and refuses to serialize it; dropping the marks makes it an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    template = tokenizer.chat_template
    if not template:
        return None
    if not isinstance(template, str):
        raise DartspecError(f"{gguf_path.name} has several named chat templates, which dartspec does not support")
    if AutoTokenizer.from_pretrained(out_dir).chat_template != template:
        # Where transformers keeps the template has moved between releases; write it where the
        # current release reads it and check again rather than ship a chat model without one.
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
        if AutoTokenizer.from_pretrained(out_dir).chat_template != template:
            raise DartspecError(f"the chat template of {gguf_path.name} did not survive conversion: please report it")
    return template


def swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``, replacing whatever is there."""
    old: Path | None = None
    if dest.exists():
        # os.replace cannot overwrite a non-empty folder, so move the old one aside first.
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_tmp_dirs(dest: Path) -> None:
    now = time.time()
    for leftover in dest.parent.glob(f".{dest.name}.*-*"):
        try:
            if leftover.is_dir() and now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DartspecError(
            f"{folder} has no {MANIFEST_NAME}, so it is not a finished dartspec conversion: "
            f"delete the folder {folder} and run again to rebuild it"
        ) from None
    except (OSError, ValueError) as exc:
        raise DartspecError(
            f"cannot read {path} ({exc}): delete the folder {folder} and run again to rebuild it"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("dartspec_manifest") != MANIFEST_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise DartspecError(
            f"{path} is from a different dartspec version: delete the folder {folder} and run again to rebuild it"
        )
    return manifest


def check_sizes(folder: Path) -> dict[str, Any]:
    """Fast integrity check: every file in the manifest exists with its recorded size."""
    manifest = _read_manifest(folder)
    for name, entry in manifest["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DartspecError(
                f"cached model at {folder} is damaged ({name} is missing): "
                f"delete the folder {folder} and run again to rebuild it"
            ) from None
        if size != entry["size"]:
            raise DartspecError(
                f"cached model at {folder} is damaged ({name} is {size} bytes, expected {entry['size']}): "
                f"delete the folder {folder} and run again to rebuild it"
            )
    return manifest


def verify_model_cache(folder: Path) -> None:
    """Check every file of a converted model folder against the sha256 in its manifest.

    Reads every byte (about a second per GB), so :func:`resolve_model` only checks sizes; call this
    when a model misbehaves or from a ``doctor``-style command.

    Raises:
        DartspecError: the manifest is missing or unreadable, or a file is missing or changed; the
            message says to delete the folder (and gives its path) so it is rebuilt.
    """
    folder = Path(folder)
    manifest = check_sizes(folder)
    for name, entry in manifest["files"].items():
        if sha256(folder / name) != entry["sha256"]:
            raise DartspecError(
                f"cached model at {folder} is damaged ({name} does not match its recorded sha256): "
                f"delete the folder {folder} and run again to rebuild it"
            )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")
