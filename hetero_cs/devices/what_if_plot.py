"""A picture of a what-if plan (``hetero-cs plan --devices ... --plot FILE.png``), drawn with matplotlib.

Two panels, from :func:`hetero_cs.devices.what_if.what_if`'s result (predictions from catalog figures, not
measurements):

* **Per card, one step.** A horizontal bar per card along the step's time: in each sub-step its predicted compute
  (labelled with its examples), then the time it waits for that sub-step's slowest card (light); for an overlapped
  plan, in each call its micro-batches back to back, then its wait for the call's slowest card. A card left out
  is marked idle.
* **Throughput.** Examples per second of the plan, of the even split (when it fits the cards' memory) and of the
  fastest card alone on the whole batch, with the speedups.

matplotlib is an optional dependency (``pip install "hetero_cs[examples]"`` or ``pip install matplotlib``); the
figure is drawn without pyplot (no display, no global state) and written atomically.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

from hetero_cs.errors import ConfigError

_BUSY, _WAIT, _OTHER = "#2b6cb0", "#e2e8f0", "#a0aec0"
_MAX_DRAWN_SUB_STEPS = 48


def check_plot_path(path) -> Path:
    """The plot's path, checked before any work: matplotlib importable, a ``.png`` name, an existing folder.

    Raises:
        ConfigError: matplotlib is not installed, the name does not end in ``.png``, or its folder does not exist.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG file; give a name ending in .png. Received: {str(path)!r}.")
    if path.is_dir():
        raise ConfigError(f"--plot {str(path)!r} is a folder; give a file name ending in .png.")
    if not path.parent.is_dir():
        raise ConfigError(f"--plot {str(path)!r}: the folder {str(path.parent)!r} does not exist; create it first.")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install matplotlib (or "
                          "pip install \"hetero_cs[examples]\").") from exc
    return path


def plot_what_if(result: dict[str, Any], path) -> Path:
    """Draws ``result`` (from :func:`~hetero_cs.devices.what_if.what_if`) into the PNG file ``path``; returns it.

    Raises:
        ConfigError: See :func:`check_plot_path`.
    """
    path = check_plot_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    caps = result["memory_caps"]
    names = [f"{i}: {name}" + ("" if caps[i] is None else f"\n(holds {caps[i]})") for i, name in
             enumerate(result["devices"])]
    figure = Figure(figsize=(12, 1.8 + 0.7 * len(names)), layout="constrained")
    FigureCanvasAgg(figure)
    timeline, throughput = figure.subplots(1, 2, width_ratios=[2.2, 1])
    _draw_step(timeline, result, names)
    _draw_throughput(throughput, result)
    figure.suptitle(f"What-if plan for {', '.join(result['devices'])}, global batch {result['global_batch_size']}\n"
                    f"(PREDICTED from catalog figures, not measured)", fontsize=10)
    descriptor, temporary = tempfile.mkstemp(suffix=".png", dir=path.parent, prefix=f".{path.stem}.")
    os.close(descriptor)
    try:
        figure.savefig(temporary, dpi=110)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp's 0600, as a plain file would be created
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _draw_step(axes, result: dict[str, Any], names: list[str]) -> None:
    step_ms = result["predicted_step_s"] * 1e3
    busy = [[t * 1e3 for t in row] for row in result["sub_step_busy_s"]]
    cuts = result["sub_step_batch_sizes"]
    calls = result.get("call_sub_steps") if result.get("overlapped") else None
    if calls:  # each card runs its micro-batches back to back within a call: a call is one bar, waits at its end
        busy, cuts = _summed(busy, calls), _summed(cuts, calls)
    if len(busy) > _MAX_DRAWN_SUB_STEPS:  # one bar per sub-step would be unreadable (and slow): groups of them
        # (a group's length is then the sum of its sub-steps' slowest cards only approximately: drawn as the
        # slowest card's sum)
        size = -(-len(busy) // _MAX_DRAWN_SUB_STEPS)
        counts = [size] * -(-len(busy) // size)
        busy, cuts = _summed(busy, counts), _summed(cuts, counts)
    R = len(names)
    start, waited = 0.0, False
    first_busy = next(i for i in range(R) if busy[0][i] > 0)
    for j, row in enumerate(busy):  # sub-step j lasts its slowest card's time; the others wait for it
        length = max(row)
        for i in range(R):
            y = R - 1 - i
            if row[i] > 0:
                axes.barh(y, row[i], left=start, color=_BUSY, edgecolor="white",
                          label="compute (examples in the sub-step)" if (i, j) == (first_busy, 0) else None)
                if row[i] > step_ms * 0.06:
                    axes.text(start + row[i] / 2, y, str(cuts[j][i]), ha="center", va="center", fontsize=7,
                              color="white")
            if length > row[i] and i not in result["idle"]:
                axes.barh(y, length - row[i], left=start + row[i], color=_WAIT, edgecolor="none",
                          label=None if waited else f"waiting for the {'call' if calls else 'sub-step'}'s slowest card")
                waited = True
        start += length
    for i in range(R):
        y = R - 1 - i
        if i in result["idle"]:
            axes.text(0, y, "  idle: left out (the others finish sooner without it)", va="center", fontsize=8,
                      color=_OTHER)
            continue
        count = result["micro_batch_counts"][i]
        detail = f"{result['per_replica_batch_sizes'][i]} examples" + (
            f"\nin {count} micro-batches of <= {result['micro_batch_sizes'][i]}" if count > 1 else "")
        axes.text(start, y, f"  {detail}", va="center", fontsize=8)
    axes.axvline(start, color="black", linewidth=0.8)
    axes.set_yticks(range(R), list(reversed(names)))
    axes.set_ylim(-0.6, R - 0.4)  # an idle card's row has no bar to size it by
    axes.set_xlim(0, max(start, step_ms) * 1.35)
    axes.set_xlabel("predicted time per step (ms)")
    grouped = "" if len(busy) == result["sub_steps"] or calls else f" (drawn in {len(busy)} groups)"
    how = f" in {len(calls)} call(s), each card's micro-batches back to back" if calls else ""
    axes.set_title(f"{result['sub_steps']} sub-step(s){how}{grouped}, predicted step {step_ms:.1f} ms", fontsize=9)
    axes.legend(loc="upper left", bbox_to_anchor=(0.0, -0.2), ncol=2, fontsize=7, frameon=False)


def _summed(rows: list, counts: list) -> list:
    """``rows`` (one per sub-step) summed card by card over consecutive runs of ``counts[k]`` sub-steps."""
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [[sum(column) for column in zip(*rows[start:start + n])] for start, n in zip(starts, counts)]


def _draw_throughput(axes, result: dict[str, Any]) -> None:
    B = result["global_batch_size"]
    columns = [("this plan", result["examples_per_s"], _BUSY)]
    if result["even_split_step_s"] is not None:
        columns.append(("even split", B / result["even_split_step_s"], _OTHER))
    columns.append((f"{result['fastest_card']} alone", B / result["fastest_card_step_s"], _OTHER))
    labels, values, colors = (list(column) for column in zip(*columns))
    bars = axes.bar(range(len(values)), values, color=colors)
    axes.set_xticks(range(len(values)), labels, fontsize=8)
    for bar, value in zip(bars, values):
        axes.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    even = result["speedup_vs_even"]
    axes.set_title(f"{result['speedup_vs_fastest']:.2f}x the fastest card alone"
                   + ("" if even is None else f"\n{even:.2f}x the even split"), fontsize=9)
    axes.set_ylabel("examples/s (predicted)")
    axes.set_ylim(0, max(values) * 1.15)
