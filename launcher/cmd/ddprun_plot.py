"""ddprun plot: training curves from ddpworker's metrics files (train.metrics_file, JSON lines).

    ddprun plot RUN.jsonl... -o curves.png|.svg [--csv curves.csv] [--label NAME]... [--title T]
    ddprun plot RUN.jsonl... --table [--table-csv scaling.csv] [--label NAME]...

One chart of four panels (loss and top-1, against time and against epoch), one colour per run, so
runs on 1, 2, 4 and 8 nodes compare at a glance: training figures as solid lines, validation as
dashed lines with points, the final evaluation as a star named by its split ("final on test", or
"final on val" where a run had no test split; the legend says when that split also chose the
weights by train.best_by),
restarts as dotted vertical lines. --csv writes the same series as rows (run, series, epoch,
time_s, step, value; the final evaluation's series are final_<split>_loss and final_<split>_top1);
it needs no matplotlib, the pictures need Debian's python3-matplotlib.

--table prints a scaling report as a Markdown table, one row per run (--table-csv writes it as
CSV): world size, global batch, lr after scaling (the "start" event's), img/s (the median of the
logged training windows), speed-up and efficiency against the run of the smallest world size
(speed-up / world-size ratio), the time from the first start to the best validation loss (restarts
included), the best validation loss, the final top-1 and top-5 with the split they were measured
on, and the restarts.

Events read (worker/train/trainer.c): "train" (step, epoch, loss, top1 if present), "eval" (validation:
loss, top1), "epoch" (val_loss, val_top1; used when a file has no "eval" events), "final" (the
evaluation, with its split), and "start"/"resume"/"restart" if present. Each may carry a UTC "time"; files without it
still plot against epoch. A restart shows as an explicit event or as a step that does not advance
(a resumed run appends to the same file from its snapshot's step). Null numbers (NaN) are gaps.
Lines that are not JSON objects are skipped with a warning naming the file and line.
"""
import argparse
import csv
import datetime
import json
import math
import os
import sys

PROG = "ddprun plot"
RESTART_EVENTS = ("start", "resume", "restart")


def warn(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


def parse_time(value):
    """Seconds since the epoch from "2026-11-25T03:04:05.678Z", or None."""
    if not isinstance(value, str):
        return None
    try:
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def number(value):
    """A float, NaN for null or anything not a number (drawn as a gap)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


class Run:
    """One metrics file: its series as lists of points (epoch, time_s, step, value)."""

    def __init__(self, path, label):
        self.path, self.label = path, label
        self.series = {k: [] for k in ("train_loss", "train_top1", "val_loss", "val_top1")}
        self.restarts = []  # (epoch, time_s, step)
        self.has_time = False
        # the final evaluation's split ("test", or "val" without a test split) and whether that
        # split also chose the weights (train.best_by on it)
        self.final_split, self.final_chose_weights = None, False

    def points(self, name):
        return self.series.get(name, [])

    def final_points(self, metric):
        return self.points(f"final_{self.final_split}_{metric}") if self.final_split else []


def read_events(path):
    """[(line number, event dict)] of a metrics file; bad lines are reported and skipped."""
    events = []
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise SystemExit(f"{PROG}: {path}: {e.strerror}")
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except ValueError as err:
                warn(f"{path}:{n}: not JSON ({err.msg}), skipped")
                continue
            if not isinstance(e, dict) or not isinstance(e.get("event"), str):
                warn(f"{path}:{n}: not a metrics event (no \"event\"), skipped")
                continue
            events.append((n, e))
    return events


def epoch_ends(events):
    """({epoch: step at its end}, {epoch: last step seen in it}): the ends from "epoch" events
    (epoch 0 ends at step 0); an epoch without one that later epochs follow ends at its last
    step seen, which is short of its end by less than the log interval."""
    ends, seen = {0: 0}, {}
    for _, e in events:
        epoch, step = e.get("epoch"), e.get("step")
        if not isinstance(epoch, int) or not isinstance(step, int):
            continue
        if e["event"] == "epoch":
            ends[epoch] = step
        seen[epoch] = max(seen.get(epoch, step), step)
    for epoch in seen:
        if epoch not in ends and any(later > epoch for later in seen):
            ends[epoch] = seen[epoch]
    return ends, seen


def fractional_epoch(epoch, step, ends, seen):
    """Where step lies in training, in epochs: epoch E (1-based, in progress) spans the steps from
    the end of E-1 to the end of E. Epochs are measured one by one because a resume may change the
    world size and so the steps per epoch. The epoch in progress at the end of the file is taken
    to be as long as the one before it, or to end at its last step seen."""
    if not isinstance(epoch, int):
        return math.nan
    if not isinstance(step, int):
        return float(epoch)
    start, end = ends.get(epoch - 1), ends.get(epoch)
    if start is not None and end is None:
        before = ends.get(epoch - 2)
        end = start + (start - before) if before is not None and start > before else seen.get(epoch)
    if start is None or end is None or end <= start:
        return float(epoch)
    return epoch - 1 + min(max((step - start) / (end - start), 0.0), 1.0)


def load_run(path, label):
    run = Run(path, label)
    events = read_events(path)
    ends, seen = epoch_ends(events)
    has_eval = any(e["event"] == "eval" for _, e in events)
    t0 = None
    last_step = None
    for _, e in events:
        t = parse_time(e.get("time"))
        if t is not None:
            run.has_time = True
            t0 = t if t0 is None else t0
        rel = t - t0 if t is not None else math.nan
        kind, step = e["event"], e.get("step")
        x = fractional_epoch(e.get("epoch"), step, ends, seen)
        if kind in RESTART_EVENTS and (kind != "start" or e.get("resumed")):
            run.restarts.append((x, rel, step))
            last_step = None  # the steps it replays are this restart's, not another one
        elif kind == "train":
            if isinstance(step, int) and last_step is not None and step <= last_step:
                run.restarts.append((x, rel, step))  # resumed from an earlier snapshot
            if isinstance(step, int):
                last_step = step
            run.series["train_loss"].append((x, rel, step, number(e.get("loss"))))
            if "top1" in e:
                run.series["train_top1"].append((x, rel, step, number(e.get("top1"))))
        elif kind == "eval" or (kind == "epoch" and not has_eval and "val_loss" in e):
            prefix = "" if kind == "eval" else "val_"
            run.series["val_loss"].append((x, rel, step, number(e.get(prefix + "loss"))))
            run.series["val_top1"].append((x, rel, step, number(e.get(prefix + "top1"))))
        elif kind == "final":
            split = e.get("split") if isinstance(e.get("split"), str) else "test"
            run.final_split = split
            run.final_chose_weights = e.get("split_chose_weights") is True
            for metric in ("loss", "top1"):
                run.series.setdefault(f"final_{split}_{metric}", []).append(
                    (x, rel, step, number(e.get(metric))))
    if not events:
        warn(f"{path}: no metrics events")
    elif not run.has_time:
        warn(f"{path}: no \"time\" in its events: left out of the plots against time")
    return run


def labels_for(paths, given):
    if given:
        if len(given) != len(paths):
            raise SystemExit(f"{PROG}: {len(given)} --label for {len(paths)} files")
        return given
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [os.path.relpath(p) for p in paths]  # e.g. runs/1/metrics.jsonl, runs/2/metrics.jsonl


class Report:
    """One run's row of the scaling report, from its metrics file."""

    def __init__(self, run, events):
        starts = [e for e in events if e["event"] == "start"]
        trains = [e for e in events if e["event"] == "train"]
        evals = [e for e in events if e["event"] == "eval" and isinstance(e.get("loss"), (int, float))]
        finals = [e for e in events if e["event"] == "final"]
        self.label = run.label
        worlds = []
        for e in starts:  # the world sizes in order, once each run of equal ones (elastic)
            if isinstance(e.get("world"), int) and (not worlds or worlds[-1] != e["world"]):
                worlds.append(e["world"])
        self.worlds = worlds
        first = starts[0] if starts else {}
        self.global_batch = first.get("global_batch")
        self.lr = first.get("lr")
        rates = sorted(e["img_per_s"] for e in trains
                       if isinstance(e.get("img_per_s"), (int, float)) and e["img_per_s"] > 0)
        self.img_per_s = rates[len(rates) // 2] if rates else None
        self.best_val_loss = self.best_split = self.time_to_best_s = None
        if evals:
            best = min(evals, key=lambda e: e["loss"])
            self.best_val_loss, self.best_split = best["loss"], best.get("split", "val")
            t0 = parse_time(first.get("time")) if first else None
            t = parse_time(best.get("time"))
            self.time_to_best_s = t - t0 if t is not None and t0 is not None else None
        final = finals[-1] if finals else {}
        self.top1, self.top5 = final.get("top1"), final.get("top5")
        self.final_split = final.get("split")
        self.final_chose_weights = final.get("split_chose_weights") is True
        self.restarts = len(run.restarts)
        self.speedup = self.efficiency = None

    @property
    def world(self):
        return self.worlds[-1] if self.worlds else None


def scaling_reports(runs, paths):
    reports = [Report(run, [e for _, e in read_events(path)]) for run, path in zip(runs, paths)]
    known = [r for r in reports if r.world and r.img_per_s]
    if known:
        base = min(known, key=lambda r: r.world)  # the smallest world size is the baseline
        for r in known:
            r.speedup = r.img_per_s / base.img_per_s
            r.efficiency = r.speedup / (r.world / base.world)
    return reports


# (Markdown heading, CSV name) of each column of the scaling report
TABLE_COLUMNS = (("run", "run"), ("world size", "world_size"), ("global batch", "global_batch"),
                 ("lr (after scaling)", "lr"), ("img/s", "img_per_s"), ("speed-up", "speedup"),
                 ("efficiency", "efficiency"), ("time to best val loss (s)", "time_to_best_s"),
                 ("best val loss", "best_val_loss"), ("final top-1", "final_top1"),
                 ("final top-5", "final_top5"), ("final split", "final_split"),
                 ("restarts", "restarts"))


def table_values(r):
    """A run's cells as values (None: unknown), in TABLE_COLUMNS' order."""
    world = "\u2192".join(map(str, r.worlds)) if len(r.worlds) > 1 else r.world
    return [r.label, world, r.global_batch, r.lr, r.img_per_s, r.speedup, r.efficiency,
            r.time_to_best_s, r.best_val_loss, r.top1, r.top5, r.final_split, r.restarts]


def is_unknown(v):
    return v is None or (isinstance(v, float) and math.isnan(v))


def write_markdown(reports, f):
    formats = {"lr": "{:.6g}", "img_per_s": "{:.0f}", "speedup": "{:.2f}", "efficiency": "{:.2f}",
               "time_to_best_s": "{:.2f}", "best_val_loss": "{:.4f}", "final_top1": "{:.4f}",
               "final_top5": "{:.4f}"}
    f.write("| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |\n")
    f.write("|" + "|".join("---" if n in ("run", "final_split") else "---:"
                           for _, n in TABLE_COLUMNS) + "|\n")
    for r in reports:
        cells = []
        for (_, name), v in zip(TABLE_COLUMNS, table_values(r)):
            text = "-" if is_unknown(v) else formats.get(name, "{}").format(v)
            if name == "best_val_loss" and r.best_split not in (None, "val") and not is_unknown(v):
                text += f" ({r.best_split})"  # no val split: validated on another
            if name == "final_split" and r.final_chose_weights:
                text += " (also chose the weights)"
            cells.append(text)
        f.write("| " + " | ".join(cells) + " |\n")
    base = [r for r in reports if r.speedup == 1.0 and r.efficiency == 1.0]
    if base:
        f.write(f"\nSpeed-up and efficiency against {base[0].label} (world size {base[0].world}); "
                "img/s is the median of the logged training windows.\n")


def write_table_csv(reports, path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([n for _, n in TABLE_COLUMNS] + ["validation_split", "final_split_chose_weights"])
        for r in reports:
            w.writerow(["" if is_unknown(v) else v for v in table_values(r)] +
                       [r.best_split or "", "true" if r.final_chose_weights else "false"])


def write_csv(runs, path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "series", "epoch", "time_s", "step", "value"])
        fmt = lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else v
        for run in runs:
            for name, points in run.series.items():
                for x, t, step, v in points:
                    w.writerow([run.label, name, fmt(x), fmt(t), fmt(step), fmt(v)])
            for x, t, step in run.restarts:
                w.writerow([run.label, "restart", fmt(x), fmt(t), fmt(step), ""])


def time_unit(runs):
    longest = max((p[1] for r in runs for pts in r.series.values() for p in pts
                   if not math.isnan(p[1])), default=0)
    if longest > 7200:
        return 3600, "hours"
    return (60, "minutes") if longest > 120 else (1, "seconds")


def segments(points):
    """The points split where the step does not advance (a resume), so that no line runs back."""
    out = []
    for p in points:
        prev = out[-1][-1] if out else None
        is_back = prev is not None and isinstance(p[2], int) and isinstance(prev[2], int) and \
            p[2] <= prev[2]
        if not out or is_back:
            out.append([])
        out[-1].append(p)
    return out


def plot(runs, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"{PROG}: drawing needs matplotlib (Debian: apt-get install "
                         "python3-matplotlib); --csv alone works without it")
    scale, unit = time_unit(runs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, metric in enumerate(("loss", "top1")):
        for col, axis in enumerate(("time", "epoch")):
            ax = axes[row][col]
            for i, run in enumerate(runs):
                if axis == "time" and not run.has_time:
                    continue
                c = colors[i % len(colors)]
                k = 0 if axis == "epoch" else 1
                div = 1 if axis == "epoch" else scale
                train = run.points(f"train_{metric}")
                for j, seg in enumerate(segments(train)):
                    ax.plot([p[k] / div for p in seg], [p[3] for p in seg], color=c, lw=1.2,
                            label=f"{run.label} train" if j == 0 else None)
                val = run.points(f"val_{metric}")
                if val:
                    ax.plot([p[k] / div for p in val], [p[3] for p in val], color=c, ls="--",
                            marker="o", ms=3, lw=1.2, label=f"{run.label} validation")
                chose = " (also chose the weights)" if run.final_chose_weights else ""
                for p in run.final_points(metric):
                    ax.plot([p[k] / div], [p[3]], color=c, marker="*", ms=11, ls="none",
                            label=f"{run.label} final on {run.final_split}{chose}")
                for n, r in enumerate(run.restarts):
                    if not math.isnan(r[k]):
                        ax.axvline(r[k] / div, color=c, ls=":", lw=1,
                                   label=f"{run.label} restart" if n == 0 else None)
            values = [y for line in ax.get_lines() for y in line.get_ydata()
                      if isinstance(y, float) and y > 0 and math.isfinite(y)]
            if metric == "loss" and values and max(values) > 20 * min(values):
                ax.set_yscale("log")  # the first steps' loss would flatten the rest
            ax.set_xlabel(f"time ({unit})" if axis == "time" else "epoch")
            ax.set_ylabel("loss" if metric == "loss" else "top-1 accuracy")
            ax.grid(True, alpha=0.3)
    handles, names = axes[0][1].get_legend_handles_labels()
    for ax in (axes[0][0], axes[1][0], axes[1][1]):
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize="small",
                   frameon=False)
    fig.suptitle(title or ", ".join(r.label for r in runs))
    fig.tight_layout(rect=(0, 0.04 + 0.025 * math.ceil(len(names) / 4), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Training and validation loss and top-1 of ddpworker "
                                "metrics files,\nagainst time and against epoch (man ddprun).",
                                epilog=f"This script: {os.path.realpath(__file__)}")
    p.add_argument("files", nargs="+", metavar="RUN.jsonl", help="train.metrics_file of a run")
    p.add_argument("-o", "--output", metavar="FILE", help="picture to write: .png, .svg or .pdf")
    p.add_argument("--csv", metavar="FILE", help="also write the series as CSV")
    p.add_argument("--label", action="append", metavar="NAME",
                   help="a run's name in the legend, once per file in order (default: file names)")
    p.add_argument("--title", metavar="TEXT", help="the chart's title")
    p.add_argument("--table", action="store_true",
                   help="print a scaling report of the runs as a Markdown table")
    p.add_argument("--table-csv", metavar="FILE", help="write the scaling report as CSV")
    a = p.parse_args(argv)
    if not a.output and not a.csv and not a.table and not a.table_csv:
        p.error("nothing to write: give -o curves.png|.svg, --csv curves.csv, --table and/or "
                "--table-csv scaling.csv")
    if a.output and os.path.splitext(a.output)[1].lower() not in (".png", ".svg", ".pdf"):
        p.error(f"-o {a.output}: the picture's name must end in .png, .svg or .pdf")
    labels = labels_for(a.files, a.label)
    runs = [load_run(f, label) for f, label in zip(a.files, labels)]
    if not any(pts for r in runs for pts in r.series.values()):
        raise SystemExit(f"{PROG}: no training or validation figures in {', '.join(a.files)}")
    if a.table or a.table_csv:
        reports = scaling_reports(runs, a.files)
        if a.table:
            write_markdown(reports, sys.stdout)
        if a.table_csv:
            write_table_csv(reports, a.table_csv)
    if a.csv:
        write_csv(runs, a.csv)
    if a.output:
        plot(runs, a.output, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
