"""One TPOT-vs-context plot (bench/tpot.py's) from several tpot JSON files, e.g. the calls of one session.

Rows are taken file by file in the order given; a later file's (mode, context, batch) replaces an earlier one's.
Before commit 13d0e16 the device path without pin cache was called `fluxion-gpu` and the cache mode
`fluxion-gpu-pincache`: files from earlier commits get today's names (`fluxion-gpu-nocache`, `fluxion-gpu`). Before
the reuse cache existed, `fluxion-gpu` had none: in a file without a `fluxion-gpu-noreuse` row or the
`mode_names: reuse` mark it becomes `fluxion-gpu-noreuse`.
Points from different files may come from different leases of the machine (`fixed` moved by up to 25% between
them), which the title says.

With --table T.json it also prints the merged grid as one markdown table (a row per context and batch: each mode's
TPOT median waited for / chained, fluxion's ratio to `fixed` both ways and to `full-host`, the GPU wait ratio of
fluxion and `fixed`, the KV read per step) and writes those rows to T.json.

Usage: python bench/tpot_plot.py bench/results/tpot_A.json bench/results/tpot_B.json --out bench/results/x.png
       [--table bench/results/x_table.json] [--fluxion-mode fluxion-gpu-early]
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
    ap.add_argument("--table", default=None, help="print the grid as a markdown table and write its rows here")
    ap.add_argument("--fluxion-mode", default="fluxion-gpu-early", help="the mode the table's ratios are fluxion's")
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
    if args.table:
        rows = grid_rows(merged, args.fluxion_mode)
        print("\n".join(markdown(rows, args.fluxion_mode)))
        Path(args.table).write_text(json.dumps({"model": data.get("model"), "machine": data.get("machine"),
                                                "commits": commits, "files": args.files, "plan": data.get("plan"),
                                                "fluxion_mode": args.fluxion_mode, "rows": rows}, indent=1))
        print(f"wrote {args.table}")


TABLE_MODES = ("fixed", "gpu-sparse", "full-host", "full-gpu")  # the baselines, in the table's column order


def table_modes(fluxion: str) -> tuple[str, ...]:
    """fluxion's mode, the device path without the pin cache (no KV on the GPU past sink + window), the baselines."""
    return tuple(dict.fromkeys((fluxion, "fluxion-gpu-nocache") + TABLE_MODES))


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def grid_rows(merged: dict[tuple[str, int, int], dict], fluxion: str) -> list[dict]:
    """One dict per (context, batch) that fluxion ran: every mode's waited / chained TPOT (ms), fluxion's ratios."""
    out = []
    for ctx, batch in sorted({(c, b) for (m, c, b) in merged if m == fluxion}):
        row: dict = {"context": ctx, "batch": batch}
        for mode in table_modes(fluxion):
            r = merged.get((mode, ctx, batch))
            if r is not None:
                row[mode] = {"tpot_ms": r["tpot_ms"], "tpot_async_ms": r.get("tpot_async_ms"),
                             "gpu_wait_ratio": r.get("gpu_wait_ratio", 0.0),
                             "kv_read_fraction": r.get("kv_read_fraction")}
        f, fx = row[fluxion], row.get("fixed")
        row["vs_fixed"] = _ratio(fx and fx["tpot_ms"], f["tpot_ms"])
        row["vs_fixed_chained"] = _ratio(fx and fx["tpot_async_ms"], f["tpot_async_ms"])
        row["vs_full_host"] = _ratio(row.get("full-host", {}).get("tpot_ms"), f["tpot_ms"])
        out.append(row)
    return out


def markdown(rows: list[dict], fluxion: str) -> list[str]:
    def ms(row: dict, mode: str) -> str:
        r = row.get(mode)
        if r is None:
            return "-"
        chained = r["tpot_async_ms"]
        return f"{r['tpot_ms']:.2f}" + (f" / {chained:.2f}" if chained is not None else "")

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    modes = table_modes(fluxion)
    lines = ["| context | B | " + " | ".join(f"{m} (ms)" for m in modes)
             + " | vs fixed (waited / chained) | vs full-host | GPU wait fluxion / fixed | KV read |",
             "|" + "---|" * (len(modes) + 6)]
    for row in rows:
        wait_fixed = row.get("fixed", {}).get("gpu_wait_ratio")
        lines.append(f"| {row['context'] // 1024}K | {row['batch']} | " + " | ".join(ms(row, m) for m in modes)
                     + f" | {x(row['vs_fixed'])} / {x(row['vs_fixed_chained'])} | {x(row['vs_full_host'])}"
                     + f" | {100 * row[fluxion]['gpu_wait_ratio']:.0f}% / "
                     + ("-" if wait_fixed is None else f"{100 * wait_fixed:.0f}%")
                     + f" | {100 * row[fluxion]['kv_read_fraction']:.1f}% |")
    return lines


if __name__ == "__main__":
    main()
