"""An experiment's summary as a text table, and its PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.record import RequestRecord
from experiments.stats import confidence_sequence_history


def _num(v: Any, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def _interval(iv: list[Any] | None, pct: bool = True) -> str:
    if not iv or iv[0] is None:
        return "-"
    f = _pct if pct else _num
    return f"[{f(iv[0])}, {f(iv[1])}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    return [line, "-" * len(line)] + ["  ".join(c.ljust(w) for c, w in zip(r, widths))
                                      for r in rows]


def format_table(summary: dict[str, Any], name: str = "") -> str:
    """The summary as plain text: arms, comparisons against the control, SRM, slot latency."""
    s = summary
    conf = round(100 * (1 - s["alpha"]))
    out = [f"experiment {name}  design={s['design']}  control={s['control']}  "
           f"unit={s['unit']}  records={s['records']}  burn-in excluded={s['excluded_burn_in']}",
           ""]
    rows = []
    for arm, a in s["arms"].items():
        lat, acc, tau = a["latency"], a["acceptance_rate"], a["tau"]
        rows.append([arm, str(a["requests"]), str(a["output_tokens"]), str(a["draft_tokens"]),
                     str(a["accepted_tokens"]),
                     f"{_num(acc['estimate'])} ±{_num(acc['se'])}",
                     f"{_num(tau['estimate'], '.3f')} ±{_num(tau['se'], '.3f')}",
                     _num(lat["ttft_s"]["p50"], ".3f"), _num(lat["tpot_s"]["p50"], ".4f"),
                     _num(lat["tpot_s"]["p99"], ".4f"), _num(lat["tokens_per_s"]["p50"], ".1f")])
    out += _table(["arm", "requests", "out tok", "drafted", "accepted", "acceptance ±se",
                   "tau ±se", "ttft p50", "tpot p50", "tpot p99", "tok/s p50"], rows)
    if s["design"] == "request":
        out.append("latency columns: not comparable between arms under design 'request' "
                   "(arms share batch steps); use design 'switchback'")
    rows, notes = [], []
    for arm, c in s["comparisons"].items():
        for m in ("acceptance_rate", "tau"):
            x = c[m]
            if x.get("lift") is None:
                rows.append([arm, m, "n/a", "-", "-", "-", "-"])
                notes.append(f"{arm} {m}: n/a, {x.get('reason', 'no data')}")
                continue
            sig = "yes" if x["significant_sequential"] else "no"
            rows.append([arm, m, _pct(x["lift"]), _interval(x["fixed"]),
                         _interval(x["sequential"]), sig,
                         _num(x["remaining_per_arm"], ".0f")])
    if rows:
        out += ["", f"against the control ({conf}% intervals)"]
        out += _table(["arm", "metric", "lift", "fixed-horizon", "confidence sequence",
                       "significant (CS)", f"{s['unit']}s still needed"], rows)
        out += notes
    if s["design"] == "switchback":
        rows = []
        for arm, c in s["comparisons"].items():
            for k, w in c["latency"].items():
                rows.append([arm, k, _num(w["diff"]), _pct(w["lift"]),
                             _interval(w["ci"], pct=False), _num(w["p_value"])])
        if rows:
            out += ["", f"latency over slots (Welch t, {conf}%)"]
            out += _table(["arm", "metric", "diff", "lift", "ci of diff", "p"], rows)
    srm = s["srm"]
    flag = "MISMATCH" if srm["flagged"] else "ok"
    out += ["", f"sample ratio ({s['unit']}s): {srm['counts']}  p={_num(srm['p_value'])}  "
                f"{flag} (flagged below p={srm['threshold']})"]
    return "\n".join(out)


def write_plots(summary: dict[str, Any], records: list[RequestRecord],
                out_dir: str | Path) -> list[Path]:
    """arms.png (tau and acceptance with intervals), positions.png (per-position acceptance),
    tpot.png (TPOT distributions), sequence.png (the confidence sequence over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    from scipy import stats

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = list(summary["arms"])
    z = stats.norm.ppf(1 - summary["alpha"] / 2)
    conf = round(100 * (1 - summary["alpha"]))
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, m, title in zip(axes, ("tau", "acceptance_rate"), ("tau", "acceptance rate")):
        xs = [i for i, a in enumerate(arms) if summary["arms"][a][m]["estimate"] is not None]
        est = [summary["arms"][arms[i]][m]["estimate"] for i in xs]
        err = [z * (summary["arms"][arms[i]][m]["se"] or 0.0) for i in xs]
        ax.bar(xs, est, yerr=err, capsize=6, color="tab:blue", alpha=0.8)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(f"{title} ({conf}% interval)")
    fig.tight_layout()
    written.append(_save(fig, out / "arms.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for a in arms:
        pos = summary["arms"][a]["per_position"]
        key = "rate" if pos and pos[0]["rate"] is not None else "per_step"
        if pos:
            ax.plot([p["position"] for p in pos], [p[key] for p in pos], marker="o",
                    label=f"{a} ({'of drafted' if key == 'rate' else 'of steps'})")
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0.0, 1.05)
    ax.set_ylabel("accepted share")
    ax.set_title("per-position acceptance")
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / "positions.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    data = [[1e3 * r.tpot_s for r in records if r.arm == a and r.tpot_s is not None]
            for a in arms]
    if any(data):
        ax.boxplot([d or [float("nan")] for d in data], tick_labels=arms)
    ax.set_ylabel("TPOT (ms)")
    note = "" if summary["design"] == "switchback" else " (not comparable under design request)"
    ax.set_title("time per output token" + note, fontsize=9 if note else None)
    fig.tight_layout()
    written.append(_save(fig, out / "tpot.png"))

    others = [a for a in arms if a != summary["control"]]
    fig, axes = plt.subplots(len(others) or 1, 2, figsize=(10, 3.5 * max(len(others), 1)),
                             squeeze=False)
    for row, arm in zip(axes, others):
        for ax, m in zip(row, ("tau", "acceptance_rate")):
            h = confidence_sequence_history(records, summary["control"], arm, m,
                                            summary["alpha"])
            ax.axhline(0.0, color="black", lw=0.8)
            if h:
                n = [p["n"] for p in h]
                ax.fill_between(n, [p["sequential"][0] for p in h],
                                [p["sequential"][1] for p in h], alpha=0.25,
                                label="confidence sequence")
                ax.plot(n, [p["fixed"][0] for p in h], "k:", lw=0.8, label="fixed-horizon")
                ax.plot(n, [p["fixed"][1] for p in h], "k:", lw=0.8)
                ax.plot(n, [p["lift"] for p in h], color="tab:red", label="lift")
                ax.legend(fontsize=7)
            else:
                why = summary["comparisons"][arm][m].get("reason", "not enough data")
                ax.text(0.5, 0.5, f"n/a: {why}", ha="center", transform=ax.transAxes)
            ax.set_title(f"{arm} vs {summary['control']}: {m} lift", fontsize=9)
            ax.set_xlabel("requests (both arms)")
    fig.tight_layout()
    written.append(_save(fig, out / "sequence.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
