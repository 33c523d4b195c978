"""A model's tokenizer — from tokenizer.json or a GGUF file's metadata — with its chat template: text <-> token ids.

A Hugging Face or MLX directory's ``tokenizer.json`` is read with the ``tokenizers`` library, its chat template
from tokenizer_config.json (or ``chat_template.jinja``). A GGUF file's vocabulary, merges and token types are
turned into the same kind of tokenizer by transformers' GGUF integration (``convert_gguf_tokenizer``, which
runs without torch), with llama.cpp's pre-tokenizer for the ``tokenizer.ggml.pre`` types transformers leaves
at GPT-2's (SmolLM2's ``smollm``: every digit on its own, then GPT-2's split; llama.cpp src/llama-vocab.cpp).
Chat templates are rendered by transformers' own Jinja renderer (``render_jinja_template``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError

# tokenizer.ggml.pre types whose llama.cpp pre-tokenizer splits every digit off first, then GPT-2's regex
# (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA)
DIGIT_SPLIT_PRE_TYPES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
# ... and those that use GPT-2's regex alone (GPT2, MPT, OLMO, JAIS), which is what transformers builds by default
GPT2_PRE_TYPES = ("gpt2", "mpt", "olmo", "jais")


def _transformers_quietly() -> None:
    """transformers without torch says so on import ("PyTorch was not found"): an advisory, not ours to print."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@dataclass
class ModelTokenizer:
    """``backend``: a ``tokenizers.Tokenizer``; ``chat_template`` (Jinja, None: the model has none); ``special``
    the template's token variables (``bos_token``, ``eos_token``); ``bos_id``: prepended to plain text (None:
    nothing, or the backend's post-processor decides); ``eos_ids``: ids that end a reply; ``source``: where the
    vocabulary came from."""

    backend: object
    chat_template: str | None
    special: dict
    bos_id: int | None
    eos_ids: tuple[int, ...]
    source: str

    def encode(self, text: str) -> np.ndarray:
        """Plain text -> token ids int64 [T] (BOS first when the model asks for it)."""
        ids = self.backend.encode(text, add_special_tokens=self.bos_id is None).ids
        return np.asarray(([self.bos_id] if self.bos_id is not None else []) + ids, dtype=np.int64)

    def chat(self, messages: str | list[dict], add_generation_prompt: bool = True) -> np.ndarray:
        """A chat (a user message, or ``[{"role", "content"}, ...]``) through the model's chat template -> token
        ids int64 [T], ready for the assistant's reply."""
        _transformers_quietly()
        from transformers.utils.chat_template_utils import render_jinja_template

        if self.chat_template is None:
            raise AnelabInputError(f"the tokenizer from {self.source} has no chat template; pass plain text")
        chat = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        rendered, _ = render_jinja_template(
            conversations=[chat],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special,
        )
        return np.asarray(self.backend.encode(rendered[0], add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def reply(self, ids) -> str:
        """The text of generated ids up to (not including) the first end-of-reply id."""
        ids = [int(i) for i in ids]
        ends = [ids.index(e) for e in self.eos_ids if e in ids]
        return self.decode(ids[: min(ends)] if ends else ids)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it (a string, or an AddedToken dict with ``content``)."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_directory(directory: Path) -> ModelTokenizer:
    """``directory/tokenizer.json`` and the chat template / special tokens of tokenizer_config.json."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
    eos = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
    return ModelTokenizer(
        backend, template, special, None, () if eos is None else (eos,), str(directory / "tokenizer.json")
    )


def _digit_split(tokenizer) -> None:
    """llama.cpp's digit-first pre-tokenizer: ``\\p{N}`` isolated, then GPT-2's byte-level split."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def tokenizer_from_gguf(reader, path: Path) -> ModelTokenizer:
    """The tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes (``reader``: gguf's GGUFReader)."""
    _transformers_quietly()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {
        name: reader.fields[f"tokenizer.{key}"].contents()
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in reader.fields
    }
    if "tokens" not in fields:
        raise AnelabInputError(f"{path}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens); pass --tokens")
    pre = fields.get("pre_tokenizer_type")
    known = set(GGUF_PRE_TOKENIZER_SPLITS) | set(DIGIT_SPLIT_PRE_TYPES) | set(GPT2_PRE_TYPES)
    if fields.get("tokenizer_type") == "gpt2" and pre not in known:
        raise AnelabInputError(
            f"{path}: GGUF tokenizer.ggml.pre {pre!r}: its pre-tokenizer is not modelled; pass --tokens"
        )
    architecture = reader.fields["general.architecture"].contents()
    try:
        backend, _ = convert_gguf_tokenizer(architecture, fields)
    except ValueError as e:
        raise AnelabInputError(f"{path}: its GGUF tokenizer cannot be built ({e}); pass --tokens") from None
    if pre in DIGIT_SPLIT_PRE_TYPES:
        _digit_split(backend)
    tokens = fields["tokens"]
    special = {
        f"{kind}_token": tokens[fields[f"{kind}_token_id"]] if f"{kind}_token_id" in fields else None
        for kind in ("bos", "eos")
    }
    add_bos = (
        "tokenizer.ggml.add_bos_token" in reader.fields and reader.fields["tokenizer.ggml.add_bos_token"].contents()
    )
    template = (
        reader.fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in reader.fields else None
    )
    eos = fields.get("eos_token_id")
    bos = fields.get("bos_token_id") if add_bos else None
    return ModelTokenizer(
        backend, template, special, bos, () if eos is None else (int(eos),), f"{path} (GGUF metadata)"
    )
