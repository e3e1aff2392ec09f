"""Copy the generated CRDs from crds/ into the Helm chart (charts/distserve/crds/).

Run after `python scripts/gen_crds.py`; tests/k8s/test_k8s_chart.py fails when the
chart's copy differs from crds/.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
TARGET = ROOT / "charts" / "distserve" / "crds"


def main() -> int:
    """Copy every CRD file; remove chart copies whose source is gone."""
    TARGET.mkdir(parents=True, exist_ok=True)
    sources = sorted(SOURCE.glob("*.yaml"))
    for path in sources:
        shutil.copyfile(path, TARGET / path.name)
    for stale in set(TARGET.glob("*.yaml")) - {TARGET / p.name for p in sources}:
        stale.unlink()
    print(f"copied {len(sources)} CRD(s) to {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
