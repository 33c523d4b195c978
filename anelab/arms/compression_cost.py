"""What a weight compression costs the whole model: each mode's sidecar arm against the uncompressed reference on
real text — logits, greedy agreement with near-ties named, and perplexity.

``anelab verify`` judges a compressed package only against its own stored weights (does the graph compute what it
stores?). What the compression itself loses is a different question, answered here on the whole model and
never bounded by numbers measured on random weights: the reference arm (fp32 ``core.reference`` attention with
the checkpoint's weights) and, per weight mode, the sidecar arm serving every attention layer from that mode's
packages prefill the same tokens of a real text (``real_text.docs_prompt``) and decode greedily. Per mode:

- ``logits_diff``: relative difference of the logits at the last prompt position (``compare.compare_runs``);
- ``greedy_agreement`` raw and excluding near-ties (``compare.NEAR_TIE_RULE``);
- ``perplexity`` of the prompt's own next tokens, exp(mean of -log p(t[i+1] | t[..i])) over positions
  0 .. P-2 from the arm's final hidden states, beside the reference's: ``perplexity_change`` = ppl / ppl_ref - 1.

An fp16 mode, when given, is the floor: the sidecar's own fp16 storage, no compression.

Two arms can carry a mode. The **sidecar arm** serves every attention layer from the mode's packages (fp16
activations and all: what a runtime would compute). The **stored-weights arm** (``StoredWeightsModel``) is the
reference decoder with each layer's projections replaced by the ones the mode's packages store
(``quantize.dequantized_weights``): the compression's cost alone, from one function per package. ``verify``
holds each package to the reference with those same stored weights, so the two arms differ by fp16 noise only.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.arms.arm_comparison import PairComparison, compare_runs
from anelab.arms.arm_runs import Arm, ArmRun, run_arms
from anelab.arms.resident import weights_for_run
from anelab.arms.sidecars import SidecarSet
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core.code_identity import code_identity
from anelab.core.decoder import lm_logits
from anelab.core.errors import AnelabInputError
from anelab.core.files import entry_lock
from anelab.core.parallel import each_when_free
from anelab.core.records import atomic_write_text
from anelab.core.weights import AttentionWeights
from anelab.sidecar import quantize
from anelab.sidecar.checks import evidence_cache as cache
from anelab.sidecar.format import package_content_hash, read_sidecar_metadata
from anelab.sidecar.mil.evaluate import SavedPackage

NLL_BLOCK_ROWS = 64  # prompt positions whose logits [rows, V] are held at once (Gemma 3's V = 262,144: 67 MB)


@dataclass
class ModeCost:
    """One weight mode's sidecar arm against the reference arm on one real text (see the module docstring)."""

    mode: str
    prompt_tokens: int
    decode: int
    logits_diff: float
    max_step_logits_diff: float
    greedy_agreement: float
    agreement_excluding_near_ties: float
    near_ties: int
    greedy_summary: str
    perplexity: float
    reference_perplexity: float
    max_layer_diff: float
    layers: list[int] | None = None  # the layers that carry the mode (None: every attention layer)

    @property
    def perplexity_change(self) -> float:
        """ppl / ppl_reference - 1 (0.01: the mode's text is 1 % more surprising to the model)."""
        return self.perplexity / self.reference_perplexity - 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity_change": self.perplexity_change}


def prompt_nll(model: ModelCheckpoint, prompt: np.ndarray, final_hidden: np.ndarray) -> np.ndarray:
    """-log p(prompt[i + 1] | prompt[.. i]) float64 [P - 1] from the hidden states after the last layer
    ``final_hidden`` float32 [P, D] (final norm and LM head of ``model``; ``NLL_BLOCK_ROWS`` rows of logits at once)."""
    prompt = np.asarray(prompt)
    if final_hidden.ndim != 2 or final_hidden.shape[0] != prompt.size or prompt.size < 2:
        raise AnelabInputError(
            f"final hidden states {list(final_hidden.shape)} do not cover a prompt of {prompt.size} tokens (need >= 2)"
        )
    head, out = model.head(), []
    for i in range(0, prompt.size - 1, NLL_BLOCK_ROWS):
        rows = final_hidden[i : min(i + NLL_BLOCK_ROWS, prompt.size - 1)]
        logits = lm_logits(rows, head, model.eps).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        targets = prompt[i + 1 : i + 1 + rows.shape[0]]
        out.append(log_z - logits[np.arange(rows.shape[0]), targets])
    return np.concatenate(out)


def perplexity(nll: np.ndarray) -> float:
    """exp(mean negative log-likelihood) of ``nll`` [N]."""
    return float(np.exp(np.mean(nll)))


def mode_cost(model: ModelCheckpoint, prompt: np.ndarray, reference: ArmRun, run: ArmRun, mode: str,
              reference_perplexity: float | None = None) -> ModeCost:  # fmt: skip
    """``run`` (the sidecar arm on ``mode``'s packages) against ``reference`` (the reference arm of the same
    ``prompt`` int [P], both with their hidden states kept) -> ``ModeCost``; ``reference_perplexity``: the
    reference's, when the caller computed it for an earlier mode."""
    if reference.hidden is None or run.hidden is None:
        raise AnelabInputError("the compression cost needs both runs' hidden states (run_arms keep_hidden=True)")
    pair: PairComparison = compare_runs(reference, run)
    if reference_perplexity is None:
        reference_perplexity = perplexity(prompt_nll(model, prompt, reference.hidden[-1]))
    return ModeCost(
        mode, int(np.size(prompt)), int(run.tokens.size), pair.prompt_logits_diff, max(pair.step_logits_diffs),
        pair.greedy_agreement, pair.agreement_excluding_near_ties, pair.near_ties, pair.greedy_summary(),
        perplexity(prompt_nll(model, prompt, run.hidden[-1])), reference_perplexity, max(pair.layer_diffs),
    )  # fmt: skip


class StoredWeightsModel:
    """A ``ModelCheckpoint`` whose attention layers in ``attention`` (layer -> ``AttentionWeights``) hold other
    projections — the ones a mode's packages store; everything else is the wrapped ``model``'s."""

    def __init__(self, model: ModelCheckpoint, attention: dict[int, AttentionWeights]):
        self.model = model
        self._attention = dict(attention)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def attention(self, layer: int) -> AttentionWeights:
        return self._attention[layer] if layer in self._attention else self.model.attention(layer)


def stored_attention(packages: dict[int, str], model: ModelCheckpoint) -> dict[int, AttentionWeights]:
    """layer -> the projections ``packages[layer]`` stores (its first function's, dequantized; refused when the
    package records a compression its graph does not hold), the rest of the layer's weights the checkpoint's."""
    out = {}
    for layer, package in packages.items():
        meta = read_sidecar_metadata(package)
        saved = SavedPackage(package)
        out[int(layer)] = quantize.dequantized_weights(
            saved, meta.functions[0], model.attention(int(layer)), meta.weights
        )
        saved.close()
    return out


def stored_weights_costs(
    model: ModelCheckpoint, prompt: np.ndarray, stored: dict[str, dict[int, AttentionWeights]], *, decode: int,
    chunk: int, partial: bool = False, reference: ArmRun | None = None, reference_perplexity: float | None = None,
) -> dict[str, ModeCost]:  # fmt: skip
    """Per mode (``stored``: mode -> layer -> the projections its packages store), the stored-weights arm against
    the reference arm on ``prompt`` (int [P]), both prefilled in chunks of ``chunk`` (``reference``: that arm's run
    when the caller has it, hidden states kept; ``reference_perplexity``: its perplexity, likewise). A mode missing a
    layer is refused unless ``partial`` (then only its layers carry the mode, and its ``ModeCost.layers`` names
    them)."""
    if not stored:
        raise AnelabInputError("no weight mode to cost: pass at least one mode's stored weights")
    model, _ = weights_for_run(model)  # read (and, when they fit, kept) once for every mode's run
    if reference is None:
        reference = run_arms(model, prompt, [Arm("reference")], decode=decode, chunk=chunk)["reference"]
    reference_ppl = reference_perplexity  # computed once for every mode
    if reference_ppl is None:
        reference_ppl = perplexity(prompt_nll(model, prompt, reference.hidden[-1]))
    costs = {}
    for mode, attention in stored.items():
        g = model.geometry
        missing = sorted({*g.full_attention_layers, *g.sliding_layers} - set(attention))
        if missing and not partial:
            raise AnelabInputError(f"{mode}: no stored weights for layer {missing[0]}; export every attention layer")
        arm = Arm(f"stored {mode}")
        run = run_arms(StoredWeightsModel(model, attention), prompt, [arm], decode=decode, chunk=chunk)[arm.name]
        costs[mode] = mode_cost(model, prompt, reference, run, mode, reference_ppl)
        costs[mode].layers = sorted(attention) if missing else None
    return costs


def compression_costs(
    model: ModelCheckpoint, prompt: np.ndarray, sidecars: dict[str, SidecarSet], *, decode: int
) -> dict[str, ModeCost]:
    """Per weight mode (``sidecars``: mode -> the sidecar set of every attention layer in that mode, one chunk width),
    its ``ModeCost`` on ``prompt`` (int [P], real text) against one reference arm run at the same chunk."""
    if not sidecars:
        raise AnelabInputError("no weight mode to cost: pass at least one mode's sidecars")
    chunks = {s.chunk for s in sidecars.values()}
    if len(chunks) > 1:
        raise AnelabInputError(f"the modes' sidecars have different chunk widths {sorted(chunks)}; export one --chunk")
    [chunk] = chunks
    reference = run_arms(model, prompt, [Arm("reference")], decode=decode, chunk=chunk)["reference"]
    costs = {}
    for mode, sidecar_set in sidecars.items():
        arm = Arm(f"sidecar {mode}", "sidecar")
        run = run_arms(model, prompt, [arm], decode=decode, sidecars=sidecar_set)[arm.name]
        costs[mode] = mode_cost(model, prompt, reference, run, mode)
    return costs


def cost_table(costs: dict[str, ModeCost]) -> str:
    """One line per mode: logits difference, greedy agreement (raw / excluding near-ties) and perplexity."""
    lines = [f"{'mode':<11} {'logits diff':>11} {'max step':>9} {'greedy':>7} {'excl. ties':>10} {'ppl':>8} "
             f"{'ppl ref.':>8} {'ppl change':>10}"]  # fmt: skip
    for c in costs.values():
        lines.append(
            f"{c.mode:<11} {c.logits_diff:>11.3%} {c.max_step_logits_diff:>9.3%} {c.greedy_agreement:>7.0%} "
            f"{c.agreement_excluding_near_ties:>10.0%} {c.perplexity:>8.3f} {c.reference_perplexity:>8.3f} "
            f"{c.perplexity_change:>+10.3%}"
        )
    return "\n".join(lines)


# ---- the evidence a study shows per weight mode, shared through the cache ---------------------------------------
@dataclass
class ModeEvidence:
    """One weight mode of one checkpoint: its packages (every attention layer, from the shared cache), the verify
    reports of ``verified`` layers on random rows (``reports``) and on real attention inputs (``real_reports``), and
    its whole-model ``cost`` (the stored-weights arm; ``sidecar_cost``: the sidecar arm, when it was run)."""

    mode: str
    packages: dict[int, str]
    reports: dict[int, object]  # layer -> sidecar.checks.verify_cases.VerifyReport
    real_reports: dict[int, object]
    cost: ModeCost | None = None
    sidecar_cost: ModeCost | None = None

    def verify_summary(self) -> dict:
        """passed (every report), the worst graph error (vs the package's own weights, judged) and the worst and
        median compression cost (vs the uncompressed weights, reported) over every verified layer and input."""
        reports = [*self.reports.values(), *self.real_reports.values()]
        graph = [c.worst for r in reports for c in r.comparisons if not c.control and not c.cost]
        cost = [max((c.worst for c in r.comparisons if c.cost), default=0.0) for r in reports]
        return {
            "mode": self.mode,
            "layers_verified": sorted(self.reports),
            "passed": all(r.passed for r in reports),
            "graph_error_max": max(graph),
            "compression_error_max": max(cost) if self.mode != "fp16" else None,
            "compression_error_median": float(np.median(cost)) if self.mode != "fp16" else None,
        }

    def to_dict(self) -> dict:
        return {
            **self.verify_summary(),
            "whole_model": None if self.cost is None else self.cost.to_dict(),
            "sidecar_arm": None if self.sidecar_cost is None else self.sidecar_cost.to_dict(),
        }


def weight_mode_evidence(
    model: ModelCheckpoint,
    cache_root,
    modes: list[str],
    prompt: np.ndarray,
    *,
    chunk: int,
    histories: list[int],
    verified: list[int],
    decode: int,
    activations: dict[int, np.ndarray] | None = None,
    use=None,
    layers: list[int] | None = None,
    reference: ReferenceRun | None = None,
) -> dict[str, ModeEvidence]:
    """Per mode: every attention layer of the opened whole ``model`` exported once (``evidence_cache.cached_export``:
    ``chunk``, ``histories``), the ``verified`` layers verified once on random rows and, with ``activations``
    (layer -> post-norm rows), on real ones (``cached_verify``), and the stored-weights arm against the reference
    on ``prompt`` (int [P], real text; prefill in chunks of ``chunk``), cached by the packages' content. ``layers``:
    only these carry the mode (the tests' quick runs; the cost then says so), default every attention layer.
    ``reference``: the reference arm's ``ReferenceRun`` of the same prompt, decode and chunk when the caller shares it.

    Each mode is one unit of work under its own lock (``core.parallel.each_when_free``): a second study asking the
    same modes meanwhile takes the modes the first has not started, and reuses the rest when they are done."""
    reference = reference if reference is not None else ReferenceRun(model, prompt, decode, chunk)
    request = {"chunk": int(chunk), "histories": [int(h) for h in histories], "verified": [int(v) for v in verified],
               "decode": int(decode), "layers": layers, "prompt": cache.activations_digest(np.asarray(prompt, np.int64)),
               "activations": None if activations is None else {str(k): cache.activations_digest(v)
                                                                for k, v in sorted(activations.items())}}  # fmt: skip

    def one_mode(mode: str, wait: bool) -> ModeEvidence | None:
        unit = {"code": code_identity(), "checkpoint": str(model.checkpoint.path), "mode": mode, **request}
        with entry_lock(Path(cache_root) / "modes" / f"{cache.content_key(unit)}.lock", wait=wait) as held:
            if not held:
                return None
            results = cache.cached_export(model.checkpoint, cache_root, chunk, histories, layers, weights_mode=mode,
                                          use=use)  # fmt: skip
            packages = {int(r.metadata.layer): str(r.package) for r in results}
            reports = {layer: cache.cached_verify(packages[layer], model.checkpoint, cache_root, use=use)
                       for layer in verified}  # fmt: skip
            real = {layer: cache.cached_verify(packages[layer], model.checkpoint, cache_root, use=use,
                                               activations=activations[layer])
                    for layer in (verified if activations is not None else [])}  # fmt: skip
            evidence = ModeEvidence(mode, packages, reports, real)
            evidence.cost = cached_mode_cost(model, prompt, mode, packages, cache_root, reference=reference,
                                             decode=decode, chunk=chunk, use=use, partial=layers is not None)  # fmt: skip
            return evidence

    return each_when_free(list(modes), one_mode)


class ReferenceRun:
    """The reference arm of ``prompt`` int [P] (``decode`` greedy tokens, prefill in chunks of ``chunk``, hidden
    states kept), run the first time it is called — by a mode's cost or the real attention inputs — then kept."""

    def __init__(self, model: ModelCheckpoint, prompt: np.ndarray, decode: int, chunk: int):
        self.model, self.prompt, self.decode, self.chunk = model, prompt, decode, chunk
        self._run: ArmRun | None = None
        self._perplexity: float | None = None

    def perplexity(self) -> float:
        """The reference arm's perplexity of the prompt's own next tokens (computed once)."""
        if self._perplexity is None:
            self._perplexity = perplexity(prompt_nll(self.model, self.prompt, self().hidden[-1]))
        return self._perplexity

    def __call__(self) -> ArmRun:
        if self._run is None:
            model, _ = weights_for_run(self.model)
            self._run = run_arms(model, self.prompt, [Arm("reference")], decode=self.decode, chunk=self.chunk)[
                "reference"
            ]
        return self._run


def cached_mode_cost(model, prompt, mode: str, packages: dict[int, str], cache_root, *, reference, decode: int,
                     chunk: int, use=None, partial: bool = False) -> ModeCost:  # fmt: skip
    """``mode``'s stored-weights arm (the projections ``packages`` store: layer -> package) against the reference
    arm (``reference()``: an ``ArmRun`` of ``prompt`` with hidden states, asked only when this is computed) ->
    ``ModeCost``, unless the same packages (content), prompt, decode and chunk were costed before
    (``cache_root/costs``). ``partial``: the packages may cover only some attention layers (the cost says which)."""
    parts = {
        "code": code_identity(),
        "mode": mode,
        "packages": {str(k): package_content_hash(p) for k, p in sorted(packages.items())},
        "prompt": cache.activations_digest(np.asarray(prompt, np.int64)),
        "decode": int(decode),
        "chunk": int(chunk),
        "partial": bool(partial),
    }
    path = Path(cache_root) / "costs" / f"{cache.content_key(parts)}.json"
    with entry_lock(path.with_suffix(".lock")):
        if path.is_file():
            with contextlib.suppress(OSError, ValueError, TypeError):
                stored = json.loads(path.read_text())
                fields = set(ModeCost.__dataclass_fields__)
                cost = ModeCost(**{k: v for k, v in stored.items() if k in fields})
                if use is not None:
                    use.count("whole-model cost", True)
                return cost
        cost = stored_weights_costs(model, prompt, {mode: stored_attention(packages, model)}, decode=decode,
                                    chunk=chunk, partial=partial, reference=reference(),
                                    reference_perplexity=reference.perplexity())[mode]  # fmt: skip
        atomic_write_text(path, json.dumps(cost.to_dict(), indent=1))
    if use is not None:
        use.count("whole-model cost", False)
    return cost
