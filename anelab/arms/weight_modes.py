"""The weight modes of a real model for notebooks 05 and 07: one request, so both read one export, one
verification and one whole-model cost per model and mode from the cache under the build directory.

``real_mode_evidence`` asks ``arms.compression_cost.weight_mode_evidence`` with the same parameters from either
notebook (``EvidenceRequest``): whichever runs first computes, the other reuses (by content, through
``sidecar.checks.evidence_cache``). The default run exports every attention layer in every mode (the whole-model cost needs
every layer's stored weights) and verifies ``sampled_layers`` (first, middle, last); ``full=True`` verifies every
layer. A second real model (e.g. a windowed one) is another ``checkpoint`` with the same request.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.arms import real_text
from anelab.arms.compression_cost import (
    ModeCost,
    ModeEvidence,
    ReferenceRun,
    compression_costs,
    weight_mode_evidence,
)
from anelab.arms.resident import weights_for_run
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core.code_identity import code_identity
from anelab.core.files import entry_lock
from anelab.core.geometry import chunk_starts
from anelab.core.records import atomic_write_bytes
from anelab.sidecar.checks.evidence_cache import (
    CACHE_DIR,
    CacheUse,
    activations_digest,
    cached_export,
    content_key,
)
from anelab.sidecar.quantize import WEIGHT_MODES


@dataclass(frozen=True)
class EvidenceRequest:
    """What both notebooks ask of a real model: a docs prompt of ``prompt_tokens`` tokens, packages of ``chunk``
    rows (functions ``histories``), ``decode`` greedy tokens per arm, the layers verified (``full``: all)."""

    prompt_tokens: int = 256
    chunk: int = 32
    decode: int = 16
    full: bool = False
    modes: tuple[str, ...] = WEIGHT_MODES
    last_layer_only: bool = False  # the quick run: the last layer alone exported in the mode, verified and costed

    @classmethod
    def for_run(cls, quick: bool, full: bool = False) -> EvidenceRequest:
        """The notebooks' request: tiny sizes for the tests (``quick``: 32 tokens, chunk 16, int8 alone on the last
        layer: the whole-model cost is then that one layer's, and says so)."""
        if quick:
            return cls(prompt_tokens=32, chunk=16, decode=3, full=False, modes=("int8",), last_layer_only=True)
        return cls(full=bool(full))

    @property
    def histories(self) -> list[int]:
        """The packages' functions: h0 and h<chunk> in a full run (the history path verified too), h0 otherwise
        (each function's package is compressed on its own: a second function doubles the export)."""
        return [0, self.chunk] if self.full else [0]

    def to_dict(self) -> dict:
        return {**asdict(self), "modes": list(self.modes), "histories": self.histories}


def sampled_layers(num_layers: int) -> list[int]:
    """The first, middle and last decoder layer (fewer when the model has fewer)."""
    return sorted({0, num_layers // 2, num_layers - 1})


@dataclass
class RealEvidence:
    """A real model's weight modes: ``evidence`` (mode -> ``ModeEvidence``), the prompt, the verified layers and what
    the cache reused (``use``)."""

    checkpoint: str
    request: EvidenceRequest
    prompt: np.ndarray
    layers: list[int]
    evidence: dict[str, ModeEvidence]
    use: CacheUse
    activations: dict[int, np.ndarray]  # layer -> the verified layers' real attention inputs float32 [P, D]

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "request": self.request.to_dict(),
            "verified_layers": self.layers,
            "modes": {m: e.to_dict() for m, e in self.evidence.items()},
        }


def real_mode_evidence(
    model: ModelCheckpoint, build_dir, request: EvidenceRequest, label: str | None = None
) -> RealEvidence:
    """Every mode of ``request`` on the opened whole ``model`` (one with a tokenizer), from the cache in
    ``build_dir/cache``."""
    model, _ = weights_for_run(model)  # one read of the weights for every run below
    tokenizer = model.checkpoint.tokenizer()
    prompt = real_text.docs_prompt(tokenizer, request.prompt_tokens)
    layers = list(range(model.num_layers)) if request.full else sampled_layers(model.num_layers)
    layers = layers[-1:] if request.last_layer_only else layers
    use = CacheUse()
    reference = ReferenceRun(model, prompt, request.decode, request.chunk)  # one prefill for the inputs and the costs
    activations = cached_attention_inputs(model, prompt, layers, request.chunk, Path(build_dir) / CACHE_DIR, use,
                                          reference=reference)  # fmt: skip
    evidence = weight_mode_evidence(
        model, Path(build_dir) / CACHE_DIR, list(request.modes), prompt, chunk=request.chunk,
        histories=request.histories, verified=layers, decode=request.decode, activations=activations, use=use,
        layers=layers if request.last_layer_only else None, reference=reference,
    )  # fmt: skip
    return RealEvidence(label or Path(model.path).name, request, prompt, layers, evidence, use, activations)


def cached_attention_inputs(model, prompt: np.ndarray, layers: list[int], chunk: int, cache_root, use=None,
                            reference=None) -> dict:  # fmt: skip
    """``real_text.attention_inputs`` (layer -> post-norm rows float32 [P, D]) unless the same model (the digests of
    all its stored tensors), prompt, layers and chunk were run before (``cache_root/activations/<key>.npz``);
    ``reference``: a ``compression_cost.ReferenceRun`` of the same prompt and chunk, whose prefill they are read from
    when they are computed."""
    tensors = model.checkpoint.tensors
    parts = {"code": code_identity(), "model": {name: tensors.digest(name) for name in sorted(tensors.names())},
             "prompt": activations_digest(np.asarray(prompt, np.int64)), "layers": list(layers), "chunk": int(chunk)}  # fmt: skip
    path = Path(cache_root) / "activations" / f"{content_key(parts)}.npz"
    with entry_lock(path.with_suffix(".lock")):
        if path.is_file():
            with np.load(path) as stored:
                if use is not None:
                    use.count("activations", True)
                return {int(name.removeprefix("layer_")): stored[name] for name in stored.files}
        run = None if reference is None else reference()
        inputs = real_text.attention_inputs(model, prompt, layers, chunk=chunk, run=run)
        buffer = io.BytesIO()
        np.savez(buffer, **{f"layer_{layer}": rows for layer, rows in inputs.items()})
        atomic_write_bytes(path, buffer.getvalue())
    if use is not None:
        use.count("activations", False)
    return inputs


def sidecar_arm_costs(model: ModelCheckpoint, build_dir, real: RealEvidence) -> dict[str, ModeCost]:
    """The full run's second arm: per mode, every attention layer served from packages with a function per chunk
    start of ``real``'s prompt (one more cached export per mode), against the reference on the same prompt; each
    mode's ``ModeEvidence.sidecar_cost`` is set."""
    starts = chunk_starts(real.prompt.size, real.request.chunk)
    sets = {}
    for mode in real.request.modes:
        results = cached_export(model.checkpoint, Path(build_dir) / CACHE_DIR, real.request.chunk, starts,
                                weights_mode=mode, use=real.use)  # fmt: skip
        sets[mode] = open_sidecars(results[0].package.parent, model, real.prompt.size)
    costs = compression_costs(model, real.prompt, sets, decode=real.request.decode)
    for mode, cost in costs.items():
        real.evidence[mode].sidecar_cost = cost
    return costs


def cost_rows(real: RealEvidence) -> list[dict]:
    """One row per mode: verify (passed, worst graph error, worst compression error) and the whole-model cost."""
    rows = []
    for mode, e in real.evidence.items():
        s, c = e.verify_summary(), e.cost
        rows.append({**s, "logits_diff": c.logits_diff, "greedy_agreement": c.greedy_agreement,
                     "agreement_excluding_near_ties": c.agreement_excluding_near_ties, "near_ties": c.near_ties,
                     "perplexity": c.perplexity, "reference_perplexity": c.reference_perplexity,
                     "perplexity_change": c.perplexity_change})  # fmt: skip
    return rows


def cost_table(real: RealEvidence) -> str:
    """The rows of ``cost_rows`` as text."""
    head = (f"{'mode':<11} {'verify':>6} {'graph err':>9} {'weights err':>11} {'logits diff':>11} {'greedy':>7} "
            f"{'excl. ties':>10} {'ppl':>8} {'ppl change':>10}")  # fmt: skip
    lines = [head]
    partial = {m: e.cost.layers for m, e in real.evidence.items() if e.cost.layers is not None}
    for r in cost_rows(real):
        comp = "-" if r["compression_error_max"] is None else f"{r['compression_error_max']:.2e}"
        lines.append(
            f"{r['mode']:<11} {'ok' if r['passed'] else 'FAIL':>6} {r['graph_error_max']:>9.2e} {comp:>11} "
            f"{r['logits_diff']:>11.3%} {r['greedy_agreement']:>7.0%} {r['agreement_excluding_near_ties']:>10.0%} "
            f"{r['perplexity']:>8.3f} {r['perplexity_change']:>+10.3%}"
        )
    lines += [f"({mode}: only layers {layers} carry the mode; the others keep the checkpoint's weights)"
              for mode, layers in partial.items()]  # fmt: skip
    return "\n".join(lines)
