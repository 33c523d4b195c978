"""What the non-attention block designs (``sidecar.designs``: mlp, gdn-proj) are built from: the reader of a block's
layers, weights and digests (``BlockReader``), their MIL program builders and their refusal of a prompt driver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.sidecar.graphs.gdn_projections import build_gdn_projection_program
from anelab.sidecar.graphs.mlp import build_mlp_program
from anelab.sidecar.quantize import require_compressible


@dataclass(frozen=True)
class BlockReader:
    """What a non-attention design reads from a checkpoint (``anelab.checkpoints.blocks``). ``kind``: what its
    package records (``anelab.block``); ``layers(checkpoint)``: the layers that have the block; ``weights(checkpoint,
    layer)``: its float32 weights, finite; ``digests(checkpoint, layer)``: tensor name -> digest of its tensors;
    ``projections``: its MIL linear ops' output names -> weight field (compression reads them back); ``outputs``:
    the function's outputs; ``source_record(checkpoint, layer, weights_mode)``: what its package records as
    ``anelab.sourceFormat``."""

    kind: str
    layers: Callable
    weights: Callable
    digests: Callable
    projections: dict[str, str]
    outputs: tuple[str, ...]
    source_record: Callable

    def require_compressible(self, mode: str, weights) -> None:
        """Refuse (one line) a compression ``mode`` that would silently skip one of ``weights``' projections."""
        require_compressible(mode, {f: getattr(weights, f).shape for f in self.projections.values()})


def build_mlp(geometry, weights, options, width: int):
    return build_mlp_program(weights, geometry.hidden_size, width)


def build_gdn_projections(geometry, weights, options, width: int):
    return build_gdn_projection_program(weights, geometry.hidden_size, width)


def no_prompt_driver(*args, **kwargs):
    raise AnelabInputError(
        "a block package's rows are independent: it has no prompt driver; run its c<C> function on each chunk"
    )
