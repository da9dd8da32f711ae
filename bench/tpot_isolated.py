"""bench/tpot.py with every (context, batch, mode) case in a fresh process, merged into one table, JSON and plot.

Why: in one process a case's time can depend on what ran before it. On the H200 `fixed` at 32K batch 1 took 26.0
and 26.4 ms when it ran after the 8K cases of the same process and 20.1-22.8 ms as a process's first case
(docs/history.md), so a ratio against it moved by a quarter with the case list.
Here each case starts from the same state: a fresh interpreter, CUDA context, allocator and native pool.

Every argument except --contexts/--batches/--modes/--out/--time-budget goes to each child unchanged; the children
run one after another (cheapest first, as tpot.py orders them) within the one --time-budget.

  python bench/tpot_isolated.py --shape llama3.1-8b --contexts 32768 131072 --batches 1 --modes fluxion-gpu fixed \
      --steps 10 --out bench/results/tpot_isolated.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpot  # noqa: E402 (summary and plot of the merged rows)

OWN = {"--contexts", "--batches", "--modes", "--out", "--time-budget"}  # set per child; the rest passes through


def passed_through(argv: list[str]) -> list[str]:
    """argv without this script's own options and their values (a value is any token not starting with --)."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token.split("=", 1)[0] in OWN
            if skipping:
                continue
        elif skipping:
            continue
        kept.append(token)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--modes", nargs="+", default=["fluxion-gpu", "fixed"])
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds for all cases together")
    ap.add_argument("--out", default="bench/results/tpot_isolated.json")
    args, _ = ap.parse_known_args()
    rest = passed_through(sys.argv[1:])
    start = time.perf_counter()
    rows: list[dict] = []
    skipped: list[str] = []
    meta: dict = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for context in sorted(args.contexts):
        for batch in sorted(args.batches):
            for mode in args.modes:
                case = f"{mode} ctx {context} batch {batch}"
                left = args.time_budget - (time.perf_counter() - start)
                if left <= 0:
                    skipped.append(f"{case}: time budget")
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    child_out = Path(tmp) / "case.json"
                    cmd = [sys.executable, str(Path(__file__).with_name("tpot.py")), *rest, "--contexts",
                           str(context), "--batches", str(batch), "--modes", mode, "--time-budget", f"{left:.0f}",
                           "--out", str(child_out)]
                    code = subprocess.run(cmd).returncode
                    if code != 0 or not child_out.is_file():
                        skipped.append(f"{case}: its process exited with {code}")
                        continue
                    result = json.loads(child_out.read_text())
                rows += result["rows"]
                skipped += result["skipped"]
                meta = result
    command = "python " + " ".join(sys.argv)
    shown = [r for r in rows if r["cuda_graphs"]] or rows  # as tpot.py shows: the graphed rows where there are any
    merged = {**{k: v for k, v in meta.items() if k not in ("rows", "skipped", "summary", "command")},
              "command": command, "isolated": "one process per case", "rows": rows, "skipped": skipped,
              "summary": tpot.summary_lines(shown)}
    out.write_text(json.dumps(merged, indent=1))
    print("\n".join(merged["summary"]), flush=True)
    for s in skipped:
        print(f"skipped {s}", flush=True)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)", flush=True)
    if rows:
        tpot.plot(shown, out.with_suffix(".png"), str(meta.get("note", "")) + " (one process per case)")


if __name__ == "__main__":
    main()
