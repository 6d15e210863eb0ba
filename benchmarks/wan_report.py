"""Turn the workers' result files of one geo-benchmark run into figures, a table and PNG plots.

Definitions (all systems train the same number of samples; the clock is the machine's, shared by
every namespace):

* training wall time: from the earliest worker's first step (channels already open) to the end of
  the latest worker's last step; the final evaluation pass is not counted;
* samples/s: samples / training wall time; speedup: samples/s over baseline A's in the same run;
* measured step time: training wall time / steps (compare with the planner's prediction);
* loss curve: the loss stage's mean micro-batch loss per step, averaged over the replicas, against
  samples seen (and against seconds since the start); final loss: the evaluation pass after the last
  step (forward only, dense links) on the loss stage, averaged over the replicas;
* bytes per link: what each worker's data-plane channel put on the wire (records, headers, AEAD tags).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def collect(job: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """One summary per system, in the order of ``job["systems"]``."""
    run = job["run"]
    per_step = job["replicas"] * run["micro_batch"] * run["micro_batches"]
    out: list[dict[str, Any]] = []
    for k, sysd in enumerate(job["systems"]):
        res = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"result-{k}-*.json"))]
        if not res:
            raise RuntimeError(f"system {sysd['name']}: no worker wrote a result")
        last = len(sysd["stages"]) - 1
        t0 = min(r["t_start"] for r in res)
        t1 = max(r["steps"][-1]["t_end"] for r in res if r["steps"])
        wall = t1 - t0
        steps = job["steps"]
        samples = steps * per_step
        loss_rs = [r for r in res if r["stage"] == last]
        curve = []
        for i in range(steps):
            ls = [r["steps"][i]["loss"] for r in loss_rs if i < len(r["steps"]) and r["steps"][i]["loss"] is not None]
            ts = [r["steps"][i]["t_end"] - t0 for r in loss_rs if i < len(r["steps"])]
            if ls:
                curve.append({"samples": (i + 1) * per_step, "t": statistics.fmean(ts), "loss": statistics.fmean(ls)})
        evals = [r["eval_loss"] for r in loss_rs if r["eval_loss"] is not None]
        links = [{"src": r["host"], "dst": h, "role": r["roles"][h], "bytes": b}
                 for r in res for h, b in sorted(r["bytes_sent"].items())]
        compute = [statistics.fmean(s["compute_s"] for s in r["steps"]) for r in res if r["steps"]]
        out.append({
            "system": sysd["name"], "description": sysd["description"],
            "stages": [{"units": job["units"][st["start"]:st["end"]], "hosts": st["replicas"]} for st in sysd["stages"]],
            "rho": sysd["rho"], "averaging": sysd["averaging"],
            "samples": samples, "steps": steps, "wall_s": wall, "samples_per_s": samples / wall,
            "measured_step_s": wall / steps, "pred_step_s": sysd["pred_step_s"],
            "pred_pipeline_step_s": sysd["pred_pipeline_step_s"], "pred_allreduce_s": sysd["pred_allreduce_s"],
            "pred_error": wall / steps / sysd["pred_step_s"] - 1.0,
            "final_loss": statistics.fmean(evals) if evals else None,
            "last_train_loss": curve[-1]["loss"] if curve else None,
            "loss_curve": curve, "links": links, "bytes_total": sum(x["bytes"] for x in links),
            "mean_compute_s_per_step": max(compute) if compute else 0.0,
        })
    base = out[0]
    for s in out:
        s["speedup_vs_A"] = s["samples_per_s"] / base["samples_per_s"]
        if s["final_loss"] is not None and base["final_loss"]:
            s["loss_vs_A"] = s["final_loss"] / base["final_loss"] - 1.0
    return out


def table(summary: list[dict[str, Any]]) -> str:
    head = ("system", "stages (hosts)", "rho", "samples/s", "speedup", "final loss", "vs A",
            "step meas", "step pred", "err", "MB sent")
    rows = [head]
    for s in summary:
        stages = " | ".join("+".join(st["hosts"]) for st in s["stages"])
        rows.append((s["system"], stages, ",".join(f"{r:g}" for r in s["rho"]) or "-",
                     f"{s['samples_per_s']:.1f}", f"{s['speedup_vs_A']:.2f}x",
                     f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "-",
                     f"{s.get('loss_vs_A', 0.0):+.1%}", f"{s['measured_step_s']:.3f}s", f"{s['pred_step_s']:.3f}s",
                     f"{s['pred_error']:+.0%}", f"{s['bytes_total'] / 1e6:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def links_table(summary: list[dict[str, Any]]) -> str:
    lines = []
    for s in summary:
        parts = [f"{x['src']}->{x['dst']} ({x['role'][0]}) {x['bytes'] / 1e6:.2f} MB" for x in s["links"]]
        lines.append(f"{s['system']}: " + "; ".join(parts))
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Loss vs samples, loss vs time, and throughput bars in one PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for s in summary:
        xs = [c["samples"] for c in s["loss_curve"]]
        axes[0].plot(xs, [c["loss"] for c in s["loss_curve"]], label=s["system"])
        axes[1].plot([c["t"] for c in s["loss_curve"]], [c["loss"] for c in s["loss_curve"]], label=s["system"])
    axes[0].set(xlabel="samples (sequences)", ylabel="training loss", title="loss vs samples")
    axes[1].set(xlabel="seconds", ylabel="training loss", title="loss vs wall time")
    names = [s["system"] for s in summary]
    axes[2].bar(names, [s["samples_per_s"] for s in summary], color="tab:blue", label="measured")
    axes[2].scatter(names, [s["samples"] / s["steps"] / s["pred_step_s"] for s in summary], color="tab:red",
                    zorder=3, label="predicted")
    axes[2].set(ylabel="samples / s", title="throughput")
    axes[2].tick_params(axis="x", rotation=20)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["collect", "links_table", "plot", "table"]
