"""What settles a verdict: for each deciding cost, the measurement that would settle it and the exact command.

``plan`` and ``decide`` both print these under a verdict that depends (``planner.verdict.verdict_for``); each
says which command it is (``plan`` sends the loads to ``decide --measure``, ``decide`` to itself).
"""

from __future__ import annotations

MAC_MEASUREMENT_PLAN = "time your model's own loads and ANE predictions on a Mac"
MAC_MEASUREMENT_DECIDE = "time this model's own loads and ANE predictions on a Mac (Core ML, cold and warm)"


def settle_commands(
    prompt_tokens: int, *, gpu_command: str, mac_command: str, mac_measurement: str
) -> dict[str, tuple[str, str]]:
    """Cost name -> (measurement, command), as ``verdict_for`` takes them: the GPU prefill is settled by the
    user's own timing (``gpu_command`` + ``--gpu-prefill-seconds S``), the per-layer loads and the ANE attention
    by measuring on a Mac (``mac_command`` + ``--measure``, described by ``mac_measurement``)."""
    mac = (mac_measurement, mac_command + " --measure")
    return {
        "gpu_prefill": (
            f"time your GPU runtime's prefill of a {prompt_tokens:,}-token prompt (seconds, S)",
            gpu_command + " --gpu-prefill-seconds S",
        ),
        "load_per_layer": mac,
        "ane_attention": mac,
    }
