"""Comparisons of arm runs and the ``compare-arms`` entry point.

Per arm pair (``compare_runs``): relative difference of the hidden state after every layer over all prompt
positions; of the logits at the last prompt position and at every decoded step; greedy token agreement; the
first layer whose difference exceeds the fp16 noise threshold; and each decoded step where the greedy tokens
differ, with the reference's top-2 logit margin there beside the arm's logits noise, labelled a near-tie or a
divergence (``label_divergences``, ``NEAR_TIE_RULE``): on real weights fp16 noise can move greedy text where the
reference's top two logits are nearly equal, which is not an error — the agreement is reported raw and
excluding near-ties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.arms.arm_runs import REFERENCE_CHUNK, Arm, ArmRun, Indexer
from anelab.arms.engines import run_arms_on
from anelab.arms.mlx_engine import MlxArmsModel, open_mlx_arms_model
from anelab.arms.sidecars import (
    BlockSidecars,
    SidecarSet,
    numpy_runner,
    open_block_sidecars,
    open_sidecars,
    runtime_runner,
)
from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.checkpoints.whole_model import DECODER_FAMILIES, ModelCheckpoint, whole_model, whole_model_support
from anelab.core.errors import AnelabInputError
from anelab.core.files import decode_utf8, parse_json, read_bytes
from anelab.core.geometry import chunk_starts
from anelab.core.limits import MAX_DECODE_TOKENS, MAX_FUNCTIONS, MAX_POSITIONS, require_at_most, require_memory
from anelab.sidecar.checks.comparison import (
    RELATIVE_ERROR_THRESHOLD,
    relative_error,
)
from anelab.sidecar.designs import GDN_PROJ
from anelab.sidecar.export import export_sidecars

NOISE = RELATIVE_ERROR_THRESHOLD  # a layer differs "beyond fp16 noise" above this relative difference
NEAR_TIE, DIVERGENCE = "near-tie", "divergence"
NEAR_TIE_RULE = (
    "near-tie: the reference's top-2 logit margin at the step is at most twice the arm's logits noise (the largest "
    "|arm - reference| logit at the prompt's last position: errors of e each can swap two logits 2e apart), and "
    "the arm's logits there are within the fp16 noise threshold (relative difference <= {noise:.0e}); otherwise "
    "a divergence"
)
ENGINES = ("auto", "numpy", "mlx")  # who runs everything but the sidecars: anelab's NumPy forward, or mlx-lm
DECODED_ON = {"numpy": "the reference path", "mlx": "mlx-lm"}


@dataclass(frozen=True)
class GreedyDivergence:
    """One decoded step where arm b's greedy token differs from arm a's (the reference's).

    reference_margin: a's top-1 minus top-2 logit at the step; arm_noise: max |b - a| over the logits at the
    prompt's last position (step 0, where both saw the same tokens); same_text_before: both had decoded the
    same tokens before this step (False: the step conditions on different texts); label: ``near-tie`` or
    ``divergence`` (``NEAR_TIE_RULE``).
    """

    step: int
    reference_token: int
    arm_token: int
    reference_margin: float
    arm_noise: float
    same_text_before: bool
    label: str

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def top2_margin(logits: np.ndarray) -> float:
    """logits [V] -> the largest minus the second largest (0 for a tie)."""
    top = np.partition(np.asarray(logits, np.float64), -2)[-2:]
    return float(top[1] - top[0])


def label_divergences(
    reference_logits: np.ndarray,
    arm_logits: np.ndarray,
    reference_tokens: np.ndarray,
    arm_tokens: np.ndarray,
    noise: float = NOISE,
) -> list[GreedyDivergence]:
    """Each step where the greedy tokens differ, labelled near-tie or divergence by ``NEAR_TIE_RULE``.

    reference_logits, arm_logits [N, V] float (row 0 at the prompt's last position, row i after feeding token
    i - 1 of that run); reference_tokens, arm_tokens int [N]; noise: the relative logits difference within which
    an arm counts as fp16 noise at the prompt's last position (beyond it, no difference is noise)."""
    ref, arm = np.asarray(reference_logits, np.float64), np.asarray(arm_logits, np.float64)
    steps = np.size(reference_tokens)
    if ref.shape != arm.shape or ref.ndim != 2 or ref.shape[0] != steps or np.size(arm_tokens) != steps or not steps:
        raise AnelabInputError(f"logits {list(ref.shape)} and {list(arm.shape)} are not one [steps, vocabulary] pair")
    arm_noise = float(np.max(np.abs(arm[0] - ref[0])))
    within = relative_error(arm[0], ref[0]) <= noise
    out = []
    for step in np.flatnonzero(np.asarray(reference_tokens) != np.asarray(arm_tokens)):
        margin = top2_margin(ref[step])
        same = bool(np.array_equal(reference_tokens[:step], arm_tokens[:step]))
        label = NEAR_TIE if within and margin <= 2 * arm_noise else DIVERGENCE
        out.append(GreedyDivergence(int(step), int(reference_tokens[step]), int(arm_tokens[step]), margin, arm_noise,
                                    same, label))  # fmt: skip
    return out


def agreement_excluding_near_ties(steps: int, divergences: list[GreedyDivergence]) -> float:
    """Greedy agreement over the steps that are not near-ties (1.0 when every step is one)."""
    ties = sum(d.label == NEAR_TIE for d in divergences)
    kept = steps - ties
    return 1.0 if kept == 0 else (kept - (len(divergences) - ties)) / kept


@dataclass
class PairComparison:
    """Arm ``b`` against arm ``a``.

    layer_diffs: relative difference of the hidden state after each layer (all prompt positions);
    step_logits_diffs: per decoded step (step 0 = the last prompt position; later steps condition on
    each arm's own tokens); first_divergent_layer: first layer above ``noise`` (None: none).
    """

    a: str
    b: str
    layer_diffs: list[float]
    step_logits_diffs: list[float]
    greedy_agreement: float
    first_divergent_step: int | None
    first_divergent_layer: int | None
    noise: float
    divergences: list[GreedyDivergence] = field(default_factory=list)
    closest: tuple[int, float, float] | None = None  # (step, reference top-2 margin, arm logits noise): the
    # reference's smallest margin while both texts were the same (how near the text came to a tie)

    @property
    def prompt_logits_diff(self) -> float:
        return self.step_logits_diffs[0]

    @property
    def near_ties(self) -> int:
        return sum(d.label == NEAR_TIE for d in self.divergences)

    @property
    def agreement_excluding_near_ties(self) -> float:
        return agreement_excluding_near_ties(len(self.step_logits_diffs), self.divergences)

    def greedy_summary(self) -> str:
        """One line: agreement raw and excluding near-ties, then each differing step (margin, noise, label)."""
        head = (f"greedy agreement {self.greedy_agreement:.1%} raw, {self.agreement_excluding_near_ties:.1%} "
                f"excluding {self.near_ties} near-tie(s)")  # fmt: skip
        steps = [
            f"step {d.step}: {d.label} (reference top-2 margin {d.reference_margin:.4g} vs arm logits noise "
            f"{d.arm_noise:.4g}{'' if d.same_text_before else '; the texts already differed'})"
            for d in self.divergences
        ]
        if self.closest is not None:
            step, margin, noise = self.closest
            head += (f"; closest call: step {step}, reference top-2 margin {margin:.4g} (near-tie band "
                     f"{2 * noise:.4g})")  # fmt: skip
        return "; ".join([head, *steps])

    @property
    def identical_text(self) -> bool:
        return self.first_divergent_step is None

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "layer_diffs": self.layer_diffs,
            "prompt_logits_diff": self.prompt_logits_diff,
            "step_logits_diffs": self.step_logits_diffs,
            "greedy_agreement": self.greedy_agreement,
            "identical_text": self.identical_text,
            "first_divergent_step": self.first_divergent_step,
            "first_divergent_layer": self.first_divergent_layer,
            "noise": self.noise,
            "greedy_agreement_excluding_near_ties": self.agreement_excluding_near_ties,
            "near_ties": self.near_ties,
            "divergences": [d.to_dict() for d in self.divergences],
            "near_tie_rule": NEAR_TIE_RULE.format(noise=self.noise),
            "closest_call": None
            if self.closest is None
            else dict(zip(("step", "reference_margin", "arm_noise"), self.closest, strict=True)),  # fmt: skip
        }


def compare_runs(a: ArmRun, b: ArmRun, noise: float = NOISE) -> PairComparison:
    """Per-layer hidden, per-step logits and greedy comparison of two runs of one prompt (the per-layer
    differences from the kept hidden states, else from those ``run_arms`` computed for the pair)."""
    if a.tokens.shape != b.tokens.shape or (a.hidden is not None and b.hidden is not None
                                            and a.hidden.shape != b.hidden.shape):  # fmt: skip
        raise AnelabInputError(f"arms {a.arm.name} and {b.arm.name} ran different prompts or decode lengths")
    if a.hidden is not None and b.hidden is not None:
        layers = [relative_error(b.hidden[i], a.hidden[i]) for i in range(a.hidden.shape[0])]
    elif a.arm.name in b.layer_diffs:
        layers = list(b.layer_diffs[a.arm.name])
    else:
        raise AnelabInputError(
            f"arms {a.arm.name} and {b.arm.name} kept no hidden states and no differences for this pair; "
            "run them with layer_pairs or keep_hidden"
        )
    steps = [relative_error(b.logits[i], a.logits[i]) for i in range(a.logits.shape[0])]
    differ = np.flatnonzero(a.tokens != b.tokens)
    beyond = [i for i, d in enumerate(layers) if d > noise]
    return PairComparison(
        a.arm.name,
        b.arm.name,
        layers,
        steps,
        float(np.mean(a.tokens == b.tokens)),
        int(differ[0]) if differ.size else None,
        beyond[0] if beyond else None,
        float(noise),
        label_divergences(a.logits, b.logits, a.tokens, b.tokens, noise),
        closest_call(a.logits, b.logits, a.tokens, b.tokens),
    )


def closest_call(reference_logits, arm_logits, reference_tokens, arm_tokens) -> tuple[int, float, float]:
    """(step, margin, noise): the step with the reference's smallest top-2 logit margin among those both runs
    reached with the same text (up to and including the first divergence), its margin, and the arm's logits
    noise (``label_divergences``). Shapes as ``label_divergences``."""
    differ = np.flatnonzero(np.asarray(reference_tokens) != np.asarray(arm_tokens))
    last = int(differ[0]) if differ.size else len(reference_tokens) - 1
    margins = [top2_margin(row) for row in np.asarray(reference_logits)[: last + 1]]
    step = int(np.argmin(margins))
    noise = float(np.max(np.abs(np.asarray(arm_logits[0], np.float64) - np.asarray(reference_logits[0], np.float64))))
    return step, float(margins[step]), noise


@dataclass
class ArmsReport:
    """Every arm's run of one prompt and the comparison of each listed pair."""

    checkpoint: Path
    prompt: np.ndarray
    decode: int
    chunk: int
    runs: dict[str, ArmRun]
    pairs: list[PairComparison]
    engine: str = "numpy"

    @property
    def weights(self):
        """How the run held the decoder weights (``arms.resident.WeightsPlan``; on mlx-lm ``mlx_engine.mlx_weights``)."""
        return next(iter(self.runs.values())).weights if self.runs else None

    def table(self) -> str:
        """The per-layer table (relative hidden difference per pair) and the summary lines."""
        heads = [f"{p.b} vs {p.a}" for p in self.pairs]
        width = max([len(h) for h in heads] + [12])
        engine = "anelab's NumPy forward" if self.engine == "numpy" else "mlx-lm"
        lines = [
            f"checkpoint {self.checkpoint}: prompt {self.prompt.size} tokens in chunks of {self.chunk} on {engine}, "
            f"{self.decode} decoded greedily on {DECODED_ON[self.engine]}",
            f"{'layer':>5}  " + "  ".join(f"{h:>{width}}" for h in heads),
        ]
        for layer in range(len(self.pairs[0].layer_diffs) if self.pairs else 0):
            lines.append(f"{layer:>5}  " + "  ".join(f"{p.layer_diffs[layer]:>{width}.3e}" for p in self.pairs))
        for p in self.pairs:
            first = "none" if p.first_divergent_layer is None else str(p.first_divergent_layer)
            step = "identical" if p.identical_text else f"first differs at step {p.first_divergent_step}"
            lines.append(
                f"{p.b} vs {p.a}: logits at the last prompt position {p.prompt_logits_diff:.3%}, max over "
                f"{len(p.step_logits_diffs)} steps {max(p.step_logits_diffs):.3%}; greedy agreement "
                f"{p.greedy_agreement:.0%} ({step}); first layer beyond {p.noise:.0e}: {first}"
            )
            if p.divergences:
                lines.append(f"  {p.greedy_summary()}")
        if any(p.divergences for p in self.pairs):
            lines.append(f"  ({NEAR_TIE_RULE.format(noise=self.pairs[0].noise)})")
        if self.weights is not None:
            lines.append(self.weights.describe())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "checkpoint": str(self.checkpoint),
            "engine": self.engine,
            "prompt_tokens": int(self.prompt.size),
            "decode": self.decode,
            "chunk": self.chunk,
            "tokens": {name: run.tokens.tolist() for name, run in self.runs.items()},
            "pairs": [p.to_dict() for p in self.pairs],
            "weights": None if self.weights is None else self.weights.to_dict(),
        }


def random_prompt(vocab_size: int, tokens: int, seed: int = 0) -> np.ndarray:
    """Token ids int64 [tokens] drawn uniformly from the vocabulary with a fixed seed."""
    if tokens < 1:
        raise AnelabInputError(f"--prompt-tokens must be >= 1, got {tokens}")
    return np.random.default_rng([int(seed), 0x7E4]).integers(0, vocab_size, int(tokens))


MAX_TOKEN_FILE_BYTES = 64 * 2**20  # a token file of MAX_POSITIONS ids written as text is ~16 MB
MAX_TOKEN_ID = 2**63 - 1  # token ids are int64 (the vocabulary check follows, against the model)


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """Token ids int64 [P] from a file: a JSON list, or integers separated by whitespace or commas. A regular
    UTF-8 file only; every id a whole number in int64, at most ``MAX_POSITIONS`` of them (one line each)."""
    path = Path(path)
    text = decode_utf8(read_bytes(path, "token file", MAX_TOKEN_FILE_BYTES), str(path), "token file")
    values = (
        parse_json(text, str(path), "token file") if text.lstrip().startswith("[") else text.replace(",", " ").split()
    )
    if not isinstance(values, list):
        raise AnelabInputError(f"{path}: token file must hold integer token ids (a JSON list or whitespace-separated)")
    tokens = []
    for v in values:
        if isinstance(v, str) and v.lstrip("+-").isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise AnelabInputError(
                f"{path}: token ids must be whole numbers, got {str(v)[:40]!r}; write integers (a JSON list or whitespace-separated)"
            )
        if not 0 <= v <= MAX_TOKEN_ID:
            raise AnelabInputError(f"{path}: token id {str(v)[:40]} is not a token id (0 .. vocabulary size - 1)")
        tokens.append(v)
    if not tokens:
        raise AnelabInputError(f"{path}: the token file is empty")
    require_at_most(f"{path}: the token count", len(tokens), MAX_POSITIONS, "split the prompt")
    return np.array(tokens, dtype=np.int64)


def require_run_fits(model, prompt_tokens: int, decode: int, arms: int) -> None:
    """Refuse, before any array is made, a prompt or decode past anelab's bounds and a run whose prompt
    activations and K/V caches alone exceed this machine's memory (``anelab.core.limits``)."""
    require_at_most("--prompt-tokens", int(prompt_tokens), MAX_POSITIONS, "use a shorter prompt")
    require_at_most("--decode", int(decode), MAX_DECODE_TOKENS, "greedy agreement needs tens of tokens, not more")
    g = model.geometry
    positions = int(prompt_tokens) + int(decode)
    cache = arms * g.num_layers * positions * g.num_kv_heads * g.head_dim * 2 * 4  # fp32 K and V per arm
    require_memory(f"a {positions:,}-position run of {arms} arms", cache + positions * g.hidden_size * 4 * arms,
                   "use a shorter --prompt-tokens")  # fmt: skip


def require_engine(engine: str) -> None:
    """Refuse (one line) an ``--engine`` other than auto, numpy or mlx."""
    if engine not in ENGINES:
        raise AnelabInputError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")


def choose_engine(checkpoint: Checkpoint, engine: str = "auto") -> str:
    """``numpy`` or ``mlx`` for a checkpoint: ``auto`` is anelab's NumPy forward where it models the family (the
    independent reference, and the faster engine off a Mac), else mlx-lm (hybrids such as Qwen 3.5, any family
    mlx-lm runs)."""
    require_engine(engine)
    if engine != "auto":
        return engine
    return "numpy" if checkpoint.model_type in DECODER_FAMILIES else "mlx"


def engine_of(model: ModelCheckpoint | MlxArmsModel) -> str:
    """The engine an opened model runs on: anelab's forward (a ``ModelCheckpoint``) or mlx-lm's."""
    return "numpy" if isinstance(model, ModelCheckpoint) else "mlx"


def open_engine_model(checkpoint: Checkpoint, engine: str = "auto") -> tuple[str, ModelCheckpoint | MlxArmsModel]:
    """(engine, the model it runs) for an opened checkpoint (``choose_engine``). A family anelab's forward does not
    model that mlx-lm cannot load either is refused in one line naming both reasons."""
    chosen = choose_engine(checkpoint, engine)
    try:
        return chosen, _open_for(checkpoint, chosen)
    except AnelabInputError as e:
        if engine != "auto" or chosen != "mlx":
            raise
        model_type = checkpoint.model_type
        raise AnelabInputError(
            f"model_type {model_type}: anelab's whole-model forward {whole_model_support(model_type)}; and {e}"
        ) from None


def _open_for(checkpoint: Checkpoint, engine: str) -> ModelCheckpoint | MlxArmsModel:
    """The model an engine runs: anelab's whole model (numpy) or mlx-lm's beside anelab's attention layers (mlx)."""
    return whole_model(checkpoint) if engine == "numpy" else open_mlx_arms_model(checkpoint)


def compare_arms(
    model: ModelCheckpoint | MlxArmsModel,
    sidecars: str | os.PathLike | None,
    prompt_tokens: int | None = None,
    *,
    decode: int = 32,
    tokens: np.ndarray | None = None,
    seed: int = 0,
    indexer: Indexer | None = None,
    chunk: int | None = None,
    compute_units: str | None = None,
    runtime=None,
    resident_budget: int | None = None,
    mlp_sidecars: str | os.PathLike | None = None,
    mlp_layers: list[int] | None = None,
    gdn_sidecars: str | os.PathLike | None = None,
    gdn_layers: list[int] | None = None,
) -> ArmsReport:
    """Run the arms on one prompt and compare them.

    Arms: ``reference``; ``sidecar`` when a sidecar directory is given; with an ``indexer``, ``folded``
    and ``causal-only`` (on the sidecars when given, else on the reference). Pairs: sidecar vs
    reference, causal-only vs folded (a sparse-indexed model is a different model from the dense
    reference, so folded is not compared with reference). ``tokens`` (int [P]) overrides the seeded
    random prompt of ``prompt_tokens`` ids. ``compute_units``: serve the sidecars through Core ML
    (``runtime_runner``; ``runtime`` defaults to this machine's, refused off-Mac) instead of NumPy.
    ``model`` (opened by ``open_engine_model``) says the engine: a ``ModelCheckpoint`` runs everything but the
    sidecars on anelab's forward (numpy; the reference arm is it too), an ``MlxArmsModel`` on mlx-lm (the reference
    arm is mlx-lm's own forward, the sidecar arm the hybrid). ``resident_budget`` (bytes, numpy engine): the
    decoder weights are kept resident when their float32 size fits it, else streamed (``arms.resident``; default
    ``RESIDENT_BUDGET_BYTES``, 0 streams).

    ``mlp_sidecars``: a directory of ``--graph mlp`` packages (NumPy evaluation; either engine): adds the arm
    ``mlp-sidecar`` (every MLP of ``mlp_layers``, default all, from its package; attention from the reference) and,
    with ``sidecars`` too, ``all-sidecar`` (both); each split is compared with the reference. ``gdn_sidecars``: a
    directory of ``--graph gdn-proj`` packages (a Qwen 3.5 hybrid, mlx engine): adds ``gdn-sidecar`` (the
    projections of ``gdn_layers``, default every linear-attention layer, from their packages).
    """

    engine = engine_of(model)
    blocks = mlp_sidecars is not None or gdn_sidecars is not None
    if blocks and compute_units is not None:
        raise AnelabInputError(
            "block sidecars are served with NumPy evaluation of the saved packages (Core ML serving is not built for "
            "them yet); drop --compute-units"
        )
    arm_count = len(split_arms(sidecars is not None, mlp_sidecars is not None, indexer, gdn_sidecars is not None))
    layers = model.checkpoint if engine == "mlx" else model  # the geometry either way
    require_run_fits(layers, prompt_tokens if tokens is None else np.size(tokens), decode, arm_count)
    prompt = random_prompt(model.vocab_size, prompt_tokens or 0, seed) if tokens is None else np.asarray(tokens)
    attention_layers = model.checkpoint if engine == "mlx" else model
    sidecar_set = open_sidecars(sidecars, attention_layers, prompt.size) if sidecars is not None else None
    if sidecar_set is not None and engine == "mlx":  # mlx-lm's order is chunk-major: keep every package open
        sidecar_set.runner = numpy_runner(sidecar_set, keep_open=len(sidecar_set.packages))
    if compute_units is not None:
        if sidecar_set is None:
            raise AnelabInputError("compute units apply to the sidecar arm; pass the sidecar directory too")
        sidecar_set.runner = runtime_runner(sidecar_set, compute_units=compute_units, runtime=runtime)
    attention_served = sidecar_set is not None
    if mlp_sidecars is not None:
        mlp_set = open_block_sidecars(mlp_sidecars, attention_layers, layers=mlp_layers)
        if engine == "mlx":  # mlx-lm's order is chunk-major: keep every package open
            mlp_set.keep_open = len(mlp_set.packages)
        sidecar_set = with_block_sidecars(sidecar_set, mlp_set)
    if gdn_sidecars is not None:
        gdn_set = open_block_sidecars(gdn_sidecars, attention_layers, GDN_PROJ, layers=gdn_layers)
        gdn_set.keep_open = len(gdn_set.packages)  # the mlx engine's order is chunk-major
        sidecar_set = with_block_sidecars(sidecar_set, gdn_set)
    arms = split_arms(attention_served, mlp_sidecars is not None, indexer, gdn_sidecars is not None)
    order = [("reference", "sidecar"), ("reference", "mlp-sidecar"), ("reference", "gdn-sidecar"),
             ("reference", "all-sidecar"), ("folded", "causal-only")]  # fmt: skip
    names = {arm.name for arm in arms}
    wanted = tuple((a, b) for a, b in order if a in names and b in names)
    options = {"resident_budget": resident_budget} if engine == "numpy" else {}
    runs = run_arms_on(engine, model, prompt, arms, decode=decode, chunk=chunk, sidecars=sidecar_set,
                       keep_hidden=False, layer_pairs=wanted, **options)  # fmt: skip
    pairs = [compare_runs(runs[a], runs[b]) for a, b in wanted]
    used = sidecar_set.chunk if sidecar_set else (chunk or REFERENCE_CHUNK)
    return ArmsReport(model.path, prompt, decode, used, runs, pairs, engine)


def with_block_sidecars(sidecars: SidecarSet | None, block: BlockSidecars) -> SidecarSet:
    """``sidecars`` (None: no attention package, the set then carries only the block's width) serving ``block`` too,
    in the field of ``SidecarSet`` named after its kind (``BlockReader.kind``: mlp, gdn); refused when the widths
    differ."""
    if sidecars is None:
        sidecars = SidecarSet(block.directory, {}, block.chunk)
    if sidecars.chunk != block.chunk:
        raise AnelabInputError(
            f"the --graph {block.design.name} sidecars' chunk ({block.chunk}) differs from the other sidecars' "
            f"({sidecars.chunk}); export them all with one --chunk"
        )
    setattr(sidecars, block.design.block.kind, block)
    return sidecars


def split_arms(attention: bool, mlp: bool, indexer: Indexer | None, gdn: bool = False) -> list[Arm]:
    """The arms of one comparison: ``reference``; for the sidecars given ``sidecar`` (attention on the sidecars),
    ``mlp-sidecar`` (MLPs on theirs), ``gdn-sidecar`` (a hybrid's GDN input projections) and, with two kinds or
    more, ``all-sidecar`` (every kind given); an indexer's ``folded`` and ``causal-only``."""
    arms = [Arm("reference")]
    if attention:
        arms.append(Arm("sidecar", "sidecar"))
    if mlp:
        arms.append(Arm("mlp-sidecar", mlp="sidecar"))
    if gdn:
        arms.append(Arm("gdn-sidecar", gdn="sidecar"))
    if attention + mlp + gdn > 1:
        served = {True: "sidecar", False: "reference"}
        arms.append(Arm("all-sidecar", served[attention], mlp=served[mlp], gdn=served[gdn]))
    if indexer is not None:
        served = "sidecar" if attention else "reference"
        arms += [Arm("folded", served, indexer, fold=True), Arm("causal-only", served, indexer, fold=False)]
    return arms


def named_with_sidecars(
    name: str, sidecars: str | os.PathLike | None, prompt_tokens: int, chunk: int = REFERENCE_CHUNK
):
    """A named checkpoint (``default-dense``: generated on first use; ``default-real``: fetched on first use) and,
    when ``sidecars`` names a directory that does not exist yet, its sidecars exported there for a
    ``prompt_tokens`` prompt. Returns (checkpoint path, sidecars)."""

    if sidecars is not None and not Path(sidecars).exists():
        require_at_most(f"the sidecars a {int(prompt_tokens):,}-token prompt in chunks of {int(chunk)} needs (one function "
                        "per chunk start)", -(-int(prompt_tokens) // int(chunk)), MAX_FUNCTIONS,
                        "use a shorter --prompt-tokens or a larger --chunk")  # fmt: skip
    checkpoint = resolve_checkpoint(name)
    if sidecars is not None and not Path(sidecars).exists():
        export_arm_sidecars(load_checkpoint(checkpoint), sidecars, chunk, prompt_tokens)
    return checkpoint, sidecars


def export_arm_sidecars(checkpoint: Checkpoint, out_dir: str | os.PathLike, chunk: int, prompt_tokens: int) -> Path:
    """Export every full-attention layer with the functions h0, hC, ... a ``prompt_tokens`` prompt needs."""

    export_sidecars(checkpoint, out_dir, int(chunk), chunk_starts(int(prompt_tokens), int(chunk)))
    return Path(out_dir)
