"""Real text for the studies: a prompt from the project's own docs tokenized by the model's tokenizer, two arms'
greedy continuations decoded as words side by side, and the real attention inputs of a prompt (what
``sidecar.checks.verify_cases`` can take in place of random rows).

Notebooks 02 and 07 run ``default-real`` (SmolLM2-135M-Instruct, ``anelab.checkpoints.real_model``) through these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from anelab.arms.arm_comparison import PairComparison, compare_runs
from anelab.arms.arm_runs import Arm, ArmRun, run_arms
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core.decoder import attention_input, embed
from anelab.core.errors import AnelabInputError
from anelab.core.paths import REPO_ROOT

# The default prompt's text: the project's README as it stood at commit a615004, frozen (prose; code blocks dropped).
# The README itself became a short front page; the committed real-text figures and the numbers quoted in notebooks
# 02 and 07 were drawn from this text, so it stays byte for byte (its SHA-256 is pinned in tests/sidecar/checks/test_real_text.py).
DOCS_SOURCE = "docs/prompt/readme-a615004.md"
_FENCE = re.compile(r"^```.*?^```[^\n]*\n?", re.MULTILINE | re.DOTALL)


def docs_text(source: str = DOCS_SOURCE) -> str:
    """A repository document (``README.md``, ``docs/**/*.md``) as prose: fenced code blocks and tables dropped."""
    path = REPO_ROOT / source
    if not path.is_file() or path.suffix != ".md":
        raise AnelabInputError(f"{source}: not a Markdown file of the repository (README.md or docs/**/*.md)")
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("|")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def docs_prompt(tokenizer, tokens: int, source: str = DOCS_SOURCE) -> np.ndarray:
    """The first ``tokens`` token ids int64 [tokens] of ``docs_text(source)`` under ``tokenizer`` (a
    ``checkpoints.tokenizer.ModelTokenizer``); refused when the document is shorter."""
    ids = tokenizer.encode(docs_text(source))
    if int(tokens) < 1 or ids.size < int(tokens):
        raise AnelabInputError(f"{source} holds {ids.size} tokens; ask for 1 .. {ids.size}, not {tokens}")
    return ids[: int(tokens)]


@dataclass
class TextPair:
    """Two arms of one prompt read as text: ``comparison`` (arms.arm_comparison.PairComparison, b against a), each arm's
    greedy continuation decoded (``text_a``, ``text_b``) and its tokens, and the reference's top-2 logit margin
    per decoded step of arm a (``margins``, [N]: how close each greedy choice was to a tie)."""

    comparison: PairComparison
    text_a: str
    text_b: str
    tokens_a: list[int]
    tokens_b: list[int]
    margins: list[float]

    @property
    def agreeing_steps(self) -> list[int]:
        """Decode steps (0 = the last prompt position) before the texts first differ: where the text agrees."""
        first = self.comparison.first_divergent_step
        return list(range(len(self.tokens_a) if first is None else first))

    def to_dict(self) -> dict:
        return {**self.comparison.to_dict(), "text_a": self.text_a, "text_b": self.text_b,
                "tokens_a": self.tokens_a, "tokens_b": self.tokens_b, "margins": self.margins}  # fmt: skip


def top2_margins(logits: np.ndarray) -> list[float]:
    """Per row of logits [N, V]: the gap between the largest and the second-largest logit."""
    top = np.sort(np.asarray(logits, np.float64), axis=-1)[:, -2:]
    return [float(m) for m in top[:, 1] - top[:, 0]]


def text_pair(a: ArmRun, b: ArmRun, tokenizer) -> TextPair:
    """Two runs of one prompt compared (``compare_runs``) and read as words with ``tokenizer``."""
    return TextPair(compare_runs(a, b), tokenizer.decode(a.tokens), tokenizer.decode(b.tokens),
                    [int(t) for t in a.tokens], [int(t) for t in b.tokens], top2_margins(a.logits))  # fmt: skip


def run_pair(model: ModelCheckpoint, prompt: np.ndarray, arms: tuple[Arm, Arm], tokenizer, **options) -> TextPair:
    """Prefill ``prompt`` (int [P]) under both arms and decode greedily (``run_arms``; ``options``: decode,
    chunk, sidecars), the second arm compared with the first per layer without keeping [L, P, D] per arm."""
    a, b = arms
    runs = run_arms(model, prompt, [a, b], keep_hidden=False, layer_pairs=((a.name, b.name),), **options)
    return text_pair(runs[a.name], runs[b.name], tokenizer)


def attention_inputs(
    model: ModelCheckpoint, prompt: np.ndarray, layers: list[int], *, chunk: int = 64, run=None
) -> dict:
    """The real attention inputs of ``prompt`` (int [P]): layer -> the post-norm rows float32 [P, D] that layer's
    attention takes, from the reference arm's prefill (fp32 ``core.reference`` attention, causal mask) in chunks of
    ``chunk`` — or from ``run``, that arm's ``ArmRun`` of the same prompt and chunk (hidden states kept), when the
    caller has it (its prefill is the same whatever it decoded after)."""
    if not layers or any(not 0 <= int(layer) < model.num_layers for layer in layers):
        raise AnelabInputError(f"layers must be within 0 .. {model.num_layers - 1}, got {layers}")
    if run is None:
        run = run_arms(model, prompt, [Arm("reference")], decode=1, chunk=chunk)["reference"]
    out = {}
    for layer in sorted({int(x) for x in layers}):
        before = embed(np.asarray(prompt), model.head()) if layer == 0 else run.hidden[layer - 1]
        out[layer] = attention_input(before, model.layer(layer), model.eps).astype(np.float32)
    return out


def docs_activations(model: ModelCheckpoint, tokens: int, *, chunk: int = 64) -> tuple[dict[int, np.ndarray], str]:
    """The real attention inputs of the first ``tokens`` tokens of ``DOCS_SOURCE`` under the checkpoint's own
    tokenizer, for every decoder layer (``attention_inputs``: layer -> float32 [tokens, D]), and a phrase saying
    where they came from. ``model``: the opened whole model; one with no tokenizer (the random test checkpoints)
    is refused in one line."""

    try:
        tokenizer = model.checkpoint.tokenizer()
    except AnelabInputError:
        raise AnelabInputError(
            f"--real-text needs a checkpoint with a tokenizer (tokenizer.json or a GGUF file's), e.g. default-real; "
            f"{model.path} has none"
        ) from None
    prompt = docs_prompt(tokenizer, tokens)
    inputs = attention_inputs(model, prompt, list(range(model.num_layers)), chunk=chunk)
    return inputs, f"real attention inputs: the first {int(tokens)} tokens of {DOCS_SOURCE} through the model"
