"""The developers' WikiText-103 for the studies' final evaluations.

The development machines and CI keep WikiText-103 in shared/wikitext-103 beside the checkout;
zosoma itself looks only where it is told (--wikitext, $ZOSOMA_WIKITEXT103) and in its download
cache, so a study that reports WikiText-103 names this folder in $ZOSOMA_WIKITEXT103 for the
zosoma runs it starts, unless one is named already.
"""

import os
from pathlib import Path

SHARED_WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "wikitext-103"


def use_shared_wikitext() -> None:
    if "ZOSOMA_WIKITEXT103" not in os.environ and (SHARED_WIKITEXT / "wiki.test.raw").is_file():
        os.environ["ZOSOMA_WIKITEXT103"] = str(SHARED_WIKITEXT)
