"""The one table format every benchmark prints: figure, value, unit, limit, ratio[, target]."""

from __future__ import annotations


def figure(name, value, unit, limit=None, target=None, notes="", higher_is_better=True):
    """One row: ratio = value / limit; ok when the ratio meets the target (at least it, or at
    most it for times, where higher_is_better is False)."""
    ratio = None if not limit or value is None else value / limit
    ok = None if target is None or ratio is None else (
        ratio >= target if higher_is_better else ratio <= target
    )
    return {"figure": name, "value": value, "unit": unit, "limit": limit, "ratio": ratio,
            "target": target, "ok": ok, "notes": notes}


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def format_figures(figures: list[dict], limit_header: str = "limit") -> str:
    """Rows of {figure, value, unit, limit, ratio[, target, ok]} as an aligned text table."""
    name_width = max([len("figure")] + [len(f["figure"]) for f in figures]) + 2
    has_target = any("target" in f for f in figures)
    header = f"{'figure':{name_width}} {'value':>10} {'unit':7} {limit_header:>10} {'ratio':>6}"
    lines = [header + (f" {'target':>6} ok" if has_target else "")]
    for f in figures:
        value = "n/a" if f["value"] is None else format(f["value"], ".2f")
        line = (
            f"{f['figure']:{name_width}} {value:>10} {f['unit']:7} "
            f"{_cell(f['limit'], '.2f'):>10} {_cell(f['ratio'], '.2f'):>6}"
        )
        if has_target:
            ok = {True: "ok", False: "MISSED", None: ""}[f.get("ok")]
            line += f" {_cell(f.get('target'), '.2f'):>6} {ok}"
        lines.append(line)
    return "\n".join(lines)


def write_json(report: object, path: str | None) -> None:
    """Write the report as JSON when a path was given (non-JSON values as strings)."""
    if path:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(report, indent=2, default=str))
