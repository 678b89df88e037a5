"""The target rows of a peer_run.py report as one Markdown table (issue 52's family table).

    python bench/peer_table.py OUT/peer_PLAN.json [--out TABLE.md]

From each step's quant_bench.py figures: decode and prefill (Strata's, and against
llama-bench's on the same file: ratio = Strata / llama.cpp, targets 1.2 and 1.0), VRAM held
after load against file + KV (at most 1.10) and the expert refill against pinned
host-to-device copies (at least 0.85). peer_run.py writes it beside its JSON after every step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Figures of quant_bench.py kept in the table (by the name after the step's label); "Strata"
# is the row saying why Strata failed on the file.
_KEPT = ("decode bs1", "prefill ", "vs llama.cpp ", "VRAM held after load",
         "refill experts", "Strata")


def target_rows(report: dict) -> list[dict]:
    """One row per kept figure of every step: step, figure (without the step's label),
    value, unit, limit (llama.cpp's figure or the target's limit), ratio, target, ok; a step
    without figures gives one row with its status."""
    rows = []
    for record in report["steps"]:
        name = record["step"]["name"]
        bench = record.get("report") or {}
        label = bench.get("label", name)
        figures = bench.get("figures", [])
        if not figures:
            rows.append({"step": name, "figure": f"({record.get('status', 'not run')})",
                         "value": None, "unit": "", "limit": None, "ratio": None,
                         "target": None, "ok": None})
        for figure in figures:
            short = figure["figure"].removeprefix(f"{label} ")
            if short.startswith(_KEPT):
                rows.append({"step": name, **figure, "figure": short})
    return rows


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table; MISSED marks a target not met."""
    lines = ["| step | figure | Strata | unit | llama.cpp / limit | ratio | target | |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ok = {True: "ok", False: "**MISSED**", None: ""}[row["ok"]]
        lines.append(f"| {row['step']} | {row['figure']} | {_cell(row['value'], '.2f')} | "
                     f"{row['unit']} | {_cell(row['limit'], '.2f')} | "
                     f"{_cell(row['ratio'], '.2f')} | {_cell(row['target'], '.2f')} | {ok} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a peer_run.py JSON (OUT/peer_PLAN.json)")
    parser.add_argument("--out", help="write the table here too")
    args = parser.parse_args()
    table = markdown(target_rows(json.loads(Path(args.report).read_text())))
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
