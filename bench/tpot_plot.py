"""One TPOT-vs-context plot (bench/tpot.py's) from several tpot JSON files, e.g. the calls of one session.

Rows are taken file by file in the order given; a later file's (mode, context, batch) replaces an earlier one's.
Before the ninth session's 13d0e16 the device path without pin cache was called `fluxion-gpu` and the cache mode
`fluxion-gpu-pincache`: files from earlier commits get today's names (`fluxion-gpu-nocache`, `fluxion-gpu`). Before
the tenth session's reuse cache, `fluxion-gpu` had none: in a file without a `fluxion-gpu-noreuse` row or the
`mode_names: reuse` mark it becomes `fluxion-gpu-noreuse`.
Points from different files may come from different leases of the machine (`fixed` moved by up to 25% between
them), which the title says.

Usage: python bench/tpot_plot.py bench/results/tpot_A.json bench/results/tpot_B.json --out bench/results/x.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpot import plot  # noqa: E402

OLD_NAMES = {"fluxion-gpu": "fluxion-gpu-nocache", "fluxion-gpu-pincache": "fluxion-gpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    merged: dict[tuple[str, int, int], dict] = {}
    commits = []
    for name in args.files:
        try:
            data = json.loads(Path(name).read_text())
            rows = data["rows"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: {name}: not a bench/tpot.py result ({e})")
        modes = {r["mode"] for r in rows}
        old = "fluxion-gpu-pincache" in modes  # the names before 13d0e16
        reuse = "fluxion-gpu-noreuse" in modes or data.get("mode_names") == "reuse"
        commits.append(str(data.get("commit", "?")))
        for r in rows:
            mode = OLD_NAMES.get(r["mode"], r["mode"]) if old else r["mode"]
            if not reuse and mode == "fluxion-gpu":  # the pin cache without the reuse cache
                mode = "fluxion-gpu-noreuse"
            merged[(mode, r["context"], r["batch"])] = r | {"mode": mode}
    title = args.title or (f"{data.get('model', '?')} on {data.get('machine', '?')}: commits {', '.join(commits)} "
                           f"(latest file per point; different leases)")
    plot(list(merged.values()), Path(args.out), title, peers=data.get("model") == "llama3.1-8b")


if __name__ == "__main__":
    main()
