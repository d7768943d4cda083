"""Turn benchmark results into results.md (tables) and PNG plots."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
from pathlib import Path
from typing import Any

import torch


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where a benchmark decoded: the CPU, its threads, torch, the device, and the GPU's name when on one."""
    about: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                             "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        about["gpu"] = torch.cuda.get_device_name(device)
    return about


def command_line(script: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run: every option spelled out, booleans as --x / --no-x, a repeated option
    (a list) once per value, values quoted for the shell where they need it, and options left at None (a default
    resolved later, such as the target's own draft) or empty left out so the line runs."""
    parts = []
    for key, value in vars(args).items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(f"--{'' if value else 'no-'}{flag}")
        elif isinstance(value, list):
            parts.extend(f"--{flag} {shlex.quote(str(item))}" for item in value)
        elif value is not None and value != "":
            parts.append(f"--{flag} {shlex.quote(str(value))}")
    return f"python {script} " + " ".join(parts)


def publish(report: dict[str, Any], text: str, out: Path | None) -> None:
    """Print a benchmark's report and, with `out`, write its raw result there (.json) and the report beside (.md)."""
    print(text)
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(text + "\n")


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def compare_tables(results: dict[str, Any]) -> list[str]:
    lines = []
    for temperature, table in results["compare"].items():
        lines += [f"### Temperature {temperature}", "",
                  "| system | category | tokens/s | speedup | alpha | accepted/round | TTFT p50 ms | TPOT p50 ms | "
                  "TPOT p99 ms | predicted | measured/predicted |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for system, cats in table.items():
            for cat, row in cats.items():
                if cat != "overall" and len(cats) > 2 and system.startswith("transformers"):
                    continue  # peers: overall only, to keep the table readable
                lines.append(
                    f"| {system} | {cat} | {_fmt(row['tokens_per_s'], 1)} | {_fmt(row['speedup'])}x | "
                    f"{_fmt(row.get('alpha'))} | {_fmt(row.get('mean_accepted_length') and row['mean_accepted_length'] - 1)} | "
                    f"{_fmt(row['ttft_p50_ms'], 0)} | {_fmt(row['tpot_p50_ms'], 1)} | {_fmt(row['tpot_p99_ms'], 1)} | "
                    f"{_fmt(row.get('predicted_speedup'))} | {_fmt(row.get('measured_over_predicted'))} |")
        lines.append("")
        positions = [(system, cats["overall"].get("acceptance_per_position")) for system, cats in table.items()]
        for system, per_pos in positions:
            if per_pos:
                lines.append(f"Acceptance by draft position ({system}): " + ", ".join(f"{a:.2f}" for a in per_pos))
        lines.append("")
    return lines


def write_report(results: dict[str, Any], out: Path) -> None:
    """results.md and the plots, from the results dict alone."""
    env = results["environment"]
    cfg = results["config"]
    lines = ["# specsample bench", "",
             f"Target `{env['target']}`, draft `{env['draft']}`, dataset `{cfg['dataset']}`, "
             f"{cfg['max_new_tokens']} new tokens, dtype {env['dtype']}, {env['threads']} threads, "
             f"torch {env['torch']}, {env['machine']}. Wall time {results['wall_seconds'] / 60:.1f} min.", ""]
    for note in results.get("notes", []):
        lines.append(f"> note: {note}")
    lines += ["", "## Speed and acceptance (baseline: target-only on our runtime)", "", *compare_tables(results)]
    sweep = results["gamma_sweep"]
    lines += ["## Gamma sweep", "",
              f"Temperature {sweep['temperature']}; theory curve E(alpha, gamma) / (1 + gamma c) with alpha "
              f"{sweep['alpha']:.3f} and c {sweep['cost_ratio']:.3f} measured in this sweep.", "",
              "| gamma | speedup | ms/token | alpha | predicted |", "|---|---|---|---|---|"]
    for p in sweep["points"]:
        lines.append(f"| {p['gamma']} | {_fmt(p['speedup'])}x | {_fmt(p['ms_per_token'], 1)} | {_fmt(p['alpha'])} | "
                     f"{_fmt(p['predicted_speedup'])} |")
    lines += ["", "## Batch size", "", "| batch | target-only tokens/s | speculative tokens/s | speedup |",
              "|---|---|---|---|"]
    for b in results["batch_sweep"]:
        lines.append(f"| {b['batch_size']} | {b['target_only_tokens_per_s']:.1f} | {b['speculative_tokens_per_s']:.1f} | "
                     f"{b['speedup']:.2f}x |")
    lines += ["", "## Losslessness (two-sample chi-square test, speculative vs target-only)", "",
              "| prompt | category | samples each | tokens | categories | chi2 | dof | p-value |",
              "|---|---|---|---|---|---|---|---|"]
    for t in results["losslessness"]:
        lines.append(f"| {t['prompt_id']} | {t['category']} | {t['samples']} | {t['tokens']} | {t['categories']} | "
                     f"{t['statistic']:.1f} | {t['dof']} | {t['p_value']:.3f} |")
    lines += ["", "Plots: speedup_vs_gamma.png, acceptance_by_position.png, speedup_by_category.png, "
              "speedup_vs_batch.png."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plots(results, out)


def _plots(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["gamma_sweep"]
    fixed = [p for p in sweep["points"] if p["gamma"] != "auto"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["gamma"] for p in fixed], [p["speedup"] for p in fixed], "o-", label="measured")
    ax.plot([t["gamma"] for t in sweep["theory"]], [t["speedup"] for t in sweep["theory"]], "--", label="theory")
    auto = [p for p in sweep["points"] if p["gamma"] == "auto"]
    if auto:
        ax.axhline(auto[0]["speedup"], color="gray", linestyle=":", label="gamma auto")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("gamma")
    ax.set_ylabel("speedup over target-only")
    ax2 = ax.twinx()
    ax2.plot([p["gamma"] for p in fixed], [p["ms_per_token"] for p in fixed], "s:", color="tab:red", alpha=0.6)
    ax2.set_ylabel("ms / token", color="tab:red")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_gamma.png", dpi=110)
    plt.close(fig)

    first = next(iter(results["compare"].values()))
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, cats in first.items():
        per_pos = cats["overall"].get("acceptance_per_position")
        if per_pos:
            ax.bar(range(1, len(per_pos) + 1), per_pos, alpha=0.7, label=system)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    spec = [name for name in first if name.startswith("specsample")]
    if spec:
        cats = [c for c in first[spec[0]] if c != "overall"] + ["overall"]
        for i, (temperature, table) in enumerate(results["compare"].items()):
            ax.bar([j + 0.8 * i / len(results["compare"]) for j in range(len(cats))],
                   [table[spec[0]][c]["speedup"] for c in cats], width=0.8 / len(results["compare"]),
                   label=f"T={temperature}")
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats, rotation=45, ha="right")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_ylabel("speedup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    batches = results["batch_sweep"]
    ax.plot([b["batch_size"] for b in batches], [b["speedup"] for b in batches], "o-")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speculative / target-only throughput")
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_batch.png", dpi=110)
    plt.close(fig)
