"""What benchmarks/balance.py reports: one case's table and figures, and the busy/idle timeline PNG (per mix and
model, each replica's busy and idle time in a median step, even split beside auto_balance; timings EMULATED)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._common import log, ms


def sample_dict(sample: Any, wall_s: float) -> dict[str, Any] | None:
    """A monitor StepSample and the step's wall time as a JSON-ready dict (None stays None)."""
    if sample is None:
        return None
    return {"step": sample.step, "batch_sizes": list(sample.per_replica_batch_sizes),
            "step_times_s": list(sample.per_replica_step_times_s), "makespan_s": sample.makespan_s,
            "straggler_wait_s": sample.straggler_wait_s, "wall_s": wall_s}


def print_case(record: dict[str, Any], *, goals: tuple[float, float]) -> None:
    """Logs one mix/model record's table and figures; ``goals`` = (efficiency, speedup fraction) on a quiet host."""
    log(f"   {'configuration':<46} {'split(s) used (steps)':<28} {'median step':>12} {'outside replicas':>17}")
    for name, c in record["configs"].items():
        splits = ", ".join(f"{'/'.join(map(str, s['split']))} ({s['steps']})" for s in c["splits_used"][:2])
        if len(c["splits_used"]) > 2:
            splits += ", ..."
        log(f"   {c['label']:<46} {splits:<28} {ms(c['median_step_s']):>12} {ms(c['median_outside_replicas_s']):>17}")
    overrun = max(c["emulation_overrun"] for c in record["configs"].values())
    log(f"   emulation check: replicas' measured times exceed their emulated times by {overrun * 100:.1f} % at most "
        f"(median step){' - real compute shows through: raise --target-ideal-ms' if overrun > 0.05 else ''}")
    log(f"   efficiency         = ideal / auto step = {ms(record['ideal_makespan_s'])} / "
        f"{ms(record['configs']['hetero_auto']['median_step_s'])} = {record['efficiency']:.3f}"
        f"   (goal >= {goals[0]})")
    log(f"   replica efficiency = ideal / auto replicas' makespan (host work outside the replicas excluded) = "
        f"{record['replica_efficiency']:.3f}")
    log(f"   speedup vs even    = {record['speedup_vs_even']:.3f}; theoretical max {record['theoretical_speedup']:.3f}"
        f" -> {record['speedup_fraction_of_theoretical']:.3f} of it   (goal >= {goals[1]})")
    log(f"   speedup vs stock   = {record['speedup_vs_stock']:.3f}  (stock CSS even split, same emulated waits)")
    log(f"   speedup vs fastest = {record['fastest']} alone on the whole batch / auto step = "
        f"{ms(record['configs']['fastest_alone']['median_step_s'])} / "
        f"{ms(record['configs']['hetero_auto']['median_step_s'])} = {record['speedup_vs_fastest']:.3f}; theoretical "
        f"{record['theoretical_speedup_vs_fastest']:.3f} (true {record['fastest']} step at B / ideal makespan) -> "
        f"{record['speedup_vs_fastest_fraction_of_theoretical']:.3f} of it   (goal >= 1.0 always, >= 0.95 x "
        f"theoretical quiet)")
    left_out = record.get("left_out")
    if left_out is not None:
        log(f"   left out: cards {left_out['hetero_auto']} by hetero_auto, {left_out['optimal']} by the true optimum "
            f"-> {'as optimal' if left_out['as_optimal'] else 'NOT as optimal'}   (goal: as optimal, and the "
            f"efficiency goal: as fast as the best subset)")
    guard = record["configs"]["hetero_auto"]["guard"]
    if guard is not None:
        log(f"   guard: {guard['outcome']} {guard['candidate']} vs {guard['incumbent']} (candidate/incumbent "
            f"{guard['median_ratio']:.3f} over {guard['pairs']} pairs); re-plans during the run: "
            f"{record['configs']['hetero_auto']['replans']}; lost to even: {record['lost_to_even']}")
    check = record["configs"]["hetero_auto"].get("alone_check")
    if check is not None:
        log(f"   guard's check against the fastest card alone: {check['outcome']} {check['candidate']} vs "
            f"{check['incumbent']} (alone/plan {check['median_ratio']:.3f} over {check['pairs']} pairs)")


def print_summary(results: list[dict[str, Any]], summary: dict[str, Any], *, policy: str) -> None:
    """Logs the summary table over mixes and models and the worst cases against the goals."""
    log("== summary (timings EMULATED)")
    log(f"   policy {policy}")
    log(f"   {'mix':<16} {'model':<5} {'efficiency':>10} {'speedup vs even':>16} {'theoretical':>12} "
        f"{'fraction':>9} {'vs stock':>9} {'vs fastest':>15} {'theoretical':>12} {'lost':>5} {'guard':>9}")
    for r in results:
        guard = r["configs"]["hetero_auto"].get("guard") or {}
        vs_fastest = f"{r['speedup_vs_fastest']:.3f} ({r['fastest']})"
        log(f"   {r['mix']:<16} {r['model']:<5} {r['efficiency']:>10.3f} {r['speedup_vs_even']:>16.3f} "
            f"{r['theoretical_speedup']:>12.3f} {r['speedup_fraction_of_theoretical']:>9.3f} "
            f"{r['speedup_vs_stock']:>9.3f} {vs_fastest:>15} {r['theoretical_speedup_vs_fastest']:>12.3f} "
            f"{str(r['lost_to_even']).lower():>5} {guard.get('outcome', '-'):>9}")
    log(f"   worst efficiency {summary['efficiency']:.3f} ({summary['efficiency_case']}, goal >= "
        f"{summary['goals'].get('efficiency', '-')}); worst speedup {summary['speedup_vs_even']:.3f} of theoretical "
        f"{summary['theoretical_speedup']:.3f} = {summary['speedup_fraction_of_theoretical']:.3f} "
        f"({summary['speedup_case']}, goal >= "
        f"{summary['goals']['speedup_fraction_of_theoretical']}); lost to even: "
        f"{summary['lost_to_even']} of {len(results)} (goal 0); goals met: {summary['goals_met']}")
    goals = summary["fastest_goals"]
    fraction_goal = goals.get("speedup_vs_fastest_fraction_of_theoretical")
    log(f"   vs the fastest card alone (worst of theoretical): {summary['speedup_vs_fastest']:.3f} of theoretical "
        f"{summary['theoretical_speedup_vs_fastest']:.3f} = "
        f"{summary['speedup_vs_fastest_fraction_of_theoretical']:.3f} ({summary['speedup_vs_fastest_case']}; goal "
        f">= 1.0{f' and >= {fraction_goal} x theoretical' if fraction_goal else ' (with --noise)'}); goals met: "
        f"{summary['fastest_goals_met']}")


def draw_timeline(results: list[dict[str, Any]], path: Path) -> Path:
    """Per mix/model row: each replica's busy and idle time in a median step, even split beside auto_balance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [0.9 + 0.4 * len(r["devices"]) for r in results]
    fig, axes = plt.subplots(len(results), 2, figsize=(13, sum(heights) + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    for row, record in enumerate(results):
        panels = [(k, record["timeline"].get(k)) for k in ("hetero_even", "hetero_auto")]
        xmax = 1.05 * max([p["wall_s"] for _, p in panels if p] + [record["even_split_makespan_s"]]) * 1e3
        for col, (name, panel) in enumerate(panels):
            ax = axes[row][col]
            ax.set_xlim(0, xmax)
            if panel is None:
                ax.text(0.5, 0.5, "no per-replica timing", ha="center", va="center", transform=ax.transAxes)
                continue
            times_ms = [t * 1e3 for t in panel["step_times_s"]]
            makespan_ms = max(times_ms)
            ys = list(range(len(times_ms)))[::-1]  # replica 0 on top
            ax.barh(ys, times_ms, color="tab:blue", height=0.6)
            ax.barh(ys, [makespan_ms - t for t in times_ms], left=times_ms, color="#e6e6e6", hatch="//",
                    edgecolor="#9a9a9a", height=0.6)
            for y, t in zip(ys, times_ms):
                ax.text(t - 0.01 * xmax, y, f"{t:.1f} ms", va="center", ha="right", fontsize=8, color="white")
            ax.axvline(panel["wall_s"] * 1e3, color="black", linestyle=":", linewidth=1.2)
            ax.axvline(record["ideal_makespan_s"] * 1e3, color="tab:green", linestyle="--", linewidth=1.2)
            ax.set_yticks(ys)
            ax.set_yticklabels([f"{d}  b={b}" for d, b in zip(record["devices"], panel["batch_sizes"])], fontsize=9)
            step_ms = record["configs"][name]["median_step_s"] * 1e3
            title = "even split" if name == "hetero_even" else "auto_balance"
            ax.set_title(f"{record['mix']} / {record['model']}, B={record['global_batch_size']}: {title}, "
                         f"median step {step_ms:.1f} ms", fontsize=10)
            if row == len(results) - 1:
                ax.set_xlabel("time within one step, ms (emulated)")
    handles = [Patch(color="tab:blue", label="busy: compute + emulated device time"),
               Patch(facecolor="#e6e6e6", hatch="//", edgecolor="#9a9a9a", label="idle: waiting for the straggler"),
               plt.Line2D([], [], color="black", linestyle=":", label="this step, wall clock (host work included)"),
               plt.Line2D([], [], color="tab:green", linestyle="--", label="ideal makespan (true profiles)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle("hetero_cs: per-replica busy and idle time within a median step (EMULATED timings; per-replica "
                 "times from the strategy's monitor)", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
