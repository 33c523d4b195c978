"""Sidecar graph designs as siblings: ``dense``, ``tiled`` and ``stateful`` (shared blocks in ``common``)."""
