"""The sweep's figures (per level) and its report: JSON with every figure, self-contained HTML with charts.

Charts are drawn by matplotlib as inline SVG (text kept as text), so the HTML file needs nothing
else to open: no script, no stylesheet, no image fetched.
"""

from __future__ import annotations

import html
import io
import json
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from bench.sweep import Level, Slo


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (linear interpolation), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def summarize(level: Level, slo: Slo) -> dict[str, Any]:
    """One level's figures: load offered and achieved, SLO attainment, latency percentiles, errors."""
    ok = [o for o in level.outcomes if o.ok]
    elapsed = level.elapsed or level.duration
    met = sum(o.meets(slo) for o in level.outcomes)
    ttfts = [o.ttft for o in ok]
    tpots = [o.tpot for o in ok if o.output_tokens > 1]
    latencies = [o.latency for o in ok]
    figures: dict[str, Any] = {
        "offered_rate": round(level.rate, 4),
        "duration_s": round(level.duration, 2),
        "elapsed_s": round(elapsed, 2),
        "sent": len(level.outcomes),
        "completed": len(ok),
        "failed": len(level.outcomes) - len(ok),
        "errors": dict(Counter(o.error for o in level.outcomes if not o.ok)),
        "error_rate": round(1 - len(ok) / len(level.outcomes), 4) if level.outcomes else 0.0,
        "slo_attainment": round(level.attainment(slo), 4),
        "meets_slo": level.attainment(slo) >= slo.attainment,
        "throughput_rps": round(len(ok) / elapsed, 4),
        "goodput_rps": round(met / elapsed, 4),
        "output_tok_s": round(sum(o.output_tokens for o in ok) / elapsed, 2),
        "max_in_flight": max((q[1] for q in level.queue), default=0),
        "max_server_queue": max((q[2] for q in level.queue if q[2] is not None), default=None),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("latency", latencies)):
        for q in (50, 90, 99):
            figures[f"{name}_p{q}_ms"] = _ms(pct(values, q / 100))
        figures[f"{name}_mean_ms"] = _ms(sum(values) / len(values)) if values else None
    return figures


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _latency_chart(levels: list[dict[str, Any]], slo: dict[str, Any]) -> str:
    fig = Figure(figsize=(10, 3.6))
    rates = [lv["offered_rate"] for lv in levels]
    limits = (slo["ttft_ms"], slo["tpot_ms"], None)
    for ax, name, limit in zip(fig.subplots(1, 3), ("ttft", "tpot", "latency"), limits, strict=True):
        for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            ax.plot(rates, [_nan(lv[f"{name}_p{q}_ms"]) for lv in levels], style, label=f"p{q}")
        if limit is not None:
            ax.axhline(limit, color="red", linewidth=1, label="SLO")
        ax.set_title({"ttft": "TTFT", "tpot": "TPOT", "latency": "end-to-end latency"}[name])
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _svg(fig)


def _goodput_chart(levels: list[dict[str, Any]]) -> str:
    fig = Figure(figsize=(10, 3.6))
    left, right = fig.subplots(1, 2)
    rates = [lv["offered_rate"] for lv in levels]
    left.plot(rates, rates, ":", color="grey", label="offered")
    left.plot(rates, [lv["throughput_rps"] for lv in levels], "o-", label="completed")
    left.plot(rates, [lv["goodput_rps"] for lv in levels], "s-", label="goodput (met the SLO)")
    left.set_title("throughput and goodput")
    left.set_ylabel("req/s")
    error_pct = [100 * lv["error_rate"] for lv in levels]
    right.bar([f"{lv['multiplier']:g}x" for lv in levels], error_pct, color="tab:red")
    right.set_ylim(0, max(1.0, 1.15 * max(error_pct)))
    right.set_title("errors")
    right.set_ylabel("% of requests sent")
    for ax in (left, right):
        ax.set_xlabel("offered load (req/s)" if ax is left else "load level")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    return _svg(fig)


def _queue_chart(levels: list[dict[str, Any]]) -> str:
    fig = Figure(figsize=(10, 3.6))
    ax = fig.subplots()
    for lv in levels:
        t = [q[0] for q in lv["queue"]]
        line = ax.plot(t, [q[1] for q in lv["queue"]], label=f"{lv['multiplier']:g}x in flight")[0]
        if any(q[2] is not None for q in lv["queue"]):
            server = [_nan(q[2]) for q in lv["queue"]]
            ax.plot(t, server, "--", color=line.get_color(), label=f"{lv['multiplier']:g}x server queue")
    ax.set_title("queue depth over time")
    ax.set_xlabel("seconds into the level")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


_COLUMNS = (
    ("offered_rate", "offered req/s"), ("sent", "sent"), ("completed", "ok"), ("error_rate", "errors"),
    ("slo_attainment", "SLO met"), ("goodput_rps", "goodput req/s"), ("output_tok_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
    ("tpot_p99_ms", "TPOT p99 ms"), ("latency_p99_ms", "latency p99 ms"), ("max_in_flight", "max in flight"),
)  # fmt: skip


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key in ("error_rate", "slo_attainment"):
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 10 else f"{value:,.0f}"
    return html.escape(str(value))


def _table(rows: list[dict[str, Any]], first: tuple[str, str]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in (first, *_COLUMNS))
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(key, row.get(key))}</td>" for key, _ in (first, *_COLUMNS)) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(data: dict[str, Any]) -> str:
    """The whole report as one HTML document."""
    slo, target, levels = data["slo"], data["target"], data["levels"]
    peak = data["peak_rate"]
    path = "/v1/chat/completions" if target["endpoint"] == "chat" else "/v1/completions"
    summary = (
        f"Peak rate meeting the SLO: <b>{peak:.3f} req/s</b>." if peak is not None
        else "<b>No rate tried met the SLO</b>: there is no peak to load at 1x/2x/3x."
    )  # fmt: skip
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Load-test sweep</title><style>",
        "body{font-family:sans-serif;margin:2em;max-width:72em}table{border-collapse:collapse;margin:1em 0}",
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}svg{max-width:100%}",
        "</style></head><body><h1>Load-test sweep</h1>",
        f"<p>{html.escape(target['base_url'] + path)}, model {html.escape(str(target['model'] or '-'))},"
        f" prompts of {target['input_words']} words, {target['output_tokens']} output tokens;"
        f" {html.escape(data['created'])}.</p>",
        f"<p>SLO: TTFT ≤ {slo['ttft_ms']:g} ms and TPOT ≤ {slo['tpot_ms']:g} ms for at least "
        f"{100 * slo['attainment']:g}% of requests. {summary}</p>",
    ]
    if levels:
        parts += [
            "<h2>Load levels</h2>", _table(levels, ("multiplier", "level")),
            "<h2>Latency against offered load</h2>", _latency_chart(levels, slo),
            "<h2>Goodput and errors against offered load</h2>", _goodput_chart(levels),
            "<h2>Queue depth</h2>", _queue_chart(levels),
        ]  # fmt: skip
        errors = {f"{lv['multiplier']:g}x": lv["errors"] for lv in levels if lv["errors"]}
        if errors:
            parts.append(f"<p>Errors by class: {html.escape(json.dumps(errors))}</p>")
    parts += ["<h2>Peak search</h2>", _table(data["search"], ("meets_slo", "met")), "</body></html>"]
    return "\n".join(parts)


def write_report(data: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write OUT/sweep.json and OUT/sweep.html."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "sweep.json", out / "sweep.html"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False))
    html_path.write_text(render_html(data))
    return json_path, html_path
