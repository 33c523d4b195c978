"""Every project path, derived once from the repository root (never recomputed elsewhere).

anelab runs from its source tree (an editable install): the recorded data, the notebooks and the
committed figures live beside the package, the generated files under ``build/``.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"  # the seeds' recorded measurements (JSON records)
MEASURED_DIR = DATA_DIR / "measured"  # fresh records (git-ignored; never overwritten)
NOTEBOOK_DIR = REPO_ROOT / "notebooks"  # the study notebooks, committed without outputs
FIGURES_DIR = REPO_ROOT / "figures"  # the committed figures and MANIFEST.json
BUILD_DIR = Path("build")  # generated files, relative to the working directory
CHECKPOINTS_DIR = BUILD_DIR / "checkpoints"  # generated checkpoints (the embedded default)
MODEL_CACHE_DIR = REPO_ROOT / "build" / "models"  # downloaded models (default-real); ANELAB_MODEL_CACHE overrides
EVIDENCE_KEY_FILE = REPO_ROOT / "build" / "evidence.key"  # seals decide's verifications (decide.evidence)
RUNS_DIR = REPO_ROOT / "runs"  # run directories of `anelab run` / `anelab batch` (git-ignored)
