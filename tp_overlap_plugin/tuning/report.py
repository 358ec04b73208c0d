"""The tables and the evidence of `tp-overlap tune`, made from everything in its store: the dispatch
table and the config tables (tuning's builders make their plain data, tables.write writes them into the
cache), the evidence markdown and a PNG beside them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from tp_overlap_plugin import files, tables
from tp_overlap_plugin.tuning.plan import PHASES, Plan
from tp_overlap_plugin.shapes import LAYER_OPS
from tp_overlap_plugin.tuning.store import DEVICE_PHASES, load_phase, store_dir


def design_tables(device_name: str, world: int, plan: Plan) -> dict:
    """{design: the dispatch table of that design's per-op rows, without a verdict} for each design the
    plan measures, from the store: what the engine check runs each design's flag engine on."""
    from tp_overlap_plugin.tuning import rules
    stored = {p: d for p in PHASES if (d := load_phase(device_name, world, p)) is not None}
    if not stored:
        return {}
    env = {**next(iter(stored.values()))["environment"], "date": datetime.date.today().isoformat()}
    return {d: rules.build({p: x["rows"] for p, x in stored.items()}, env, margin=plan.margin, command="",
                           fused_ops=d) for d in plan.designs}


def build_tables(device_name: str, world: int, plan: Plan, summary: dict | None = None) -> dict:
    """The dispatch table (with the engine's verdict) and the config tables from everything in the
    store (every model tuned here at this TP size), written atomically into the cache under their
    locks; the evidence markdown (with this run's wall time per phase: `summary`) and PNG beside them.
    Returns the paths."""
    # a shipped-shapes run measures the config tables alone: the dispatch table (per TP size) is left as is
    phases = DEVICE_PHASES if plan.shapes == "shipped" else PHASES + ("engine",)
    stored = {p: d for p in phases if (d := load_phase(device_name, world, p)) is not None}
    if not stored:
        return {}
    env = next(iter(stored.values()))["environment"]
    env = {**env, "date": datetime.date.today().isoformat()}
    out, md, table = {}, "", None
    if plan.shapes == "model":
        table, md = _dispatch_table(world, plan, stored, env)
        out["dispatch"] = tables.write("dispatch", device_name, world, table)
    for kind, phase, title, write in (("gemm", "gemm_configs", "GEMM core configs", write_gemm_table),
                                      ("decode", "decode_configs", "Decode matmul configs", write_decode_table)):
        written = write(device_name, world, plan) if phase in stored else None
        if written:
            out[kind], tmd = written
            md += f"\n# {title}\n\n" + tmd
    if summary:
        md += run_markdown(plan, summary)
    # (the config tables are per device: a shipped-shapes run's evidence is too)
    stem = tables.cache_dir() / "evidence" / (f"{tables.device_key(device_name)}-tp{world}" if table is not None
                                              else f"{tables.device_key(device_name)}-shipped")
    head = _header(table, plan) if table is not None else _shipped_header(env, plan)
    files.write_atomic(stem.with_suffix(".md"), drop_empty_sections(head + md))
    out["evidence"] = stem.with_suffix(".md")
    if table is not None:
        png = _chart(table, stem.with_suffix(".png"))
        out["png"] = png or "no PNG: matplotlib is not installed (pip install matplotlib)"
    return out


def _dispatch_command(world: int, plan: Plan, models: list[str]) -> str:
    """The table holds the rows of every model tuned into this cache at this TP size: measuring it
    again takes one run per model, this run's last."""
    others = [m for m in models if m != plan.model]
    return " && ".join(tables.tune_command(world, m, plan.fused_ops) for m in [*others, plan.model])


def _dispatch_table(world: int, plan: Plan, stored: dict, env: dict) -> tuple[dict, str]:
    """The dispatch table of the stored rows (with the engine's verdict), and its markdown."""
    from tp_overlap_plugin.tuning import rules
    models = sorted({r.get("shape", "").split(" ")[0] for p in ("gemv", "gemm_ar") if p in stored
                     for r in stored[p]["rows"].values()} - {""})
    table = rules.build({p: d["rows"] for p, d in stored.items()}, env, margin=plan.margin,
                        engine_margin=plan.engine_margin,
                        command=_dispatch_command(world, plan, models),
                        extra={"models": models, "tuned_by": "tp-overlap tune"}, fused_ops=plan.fused_ops)
    md = rules.markdown(table, [(LAYER_OPS[layer], k, n) for layer, k, n in plan.dims.layers(world)], plan.model)
    norm_rows = [r for r in stored.get("all_reduce", {"rows": {}})["rows"].values()
                 if "tokens" in r and "row_failed" not in r]
    if norm_rows:
        md += _norm_markdown(norm_rows)
    return table, md


def write_gemm_table(device_name: str, world: int, plan: Plan) -> tuple[Path, str] | None:
    """The GEMM config table of the gemm_configs phase's stored rows into the cache (naming the plan's
    command, the one that measures it again); its path and markdown (None: nothing measured). A
    shipped-shapes run's table names its results file, written beside the evidence with its markdown:
    what bench/results keeps of a shipped table (test_bench_scripts.py makes the table again of it)."""
    from tp_overlap_plugin.tuning import gemm_configs as gc
    from tp_overlap_plugin.tuning.results import header
    stored = load_phase(device_name, world, "gemm_configs")
    if not stored or not stored["rows"]:
        return None
    payload = {"environment": {**stored["environment"], "tp": world},
               "candidates": stored.get("candidates", {"large": [], "small": []}),
               "results": sorted((e for e in stored["rows"].values() if "row_failed" not in e),
                                 key=lambda e: (-e["M"], e["K"], e["N"])),
               "stopped": None, "crashed": stored.get("crashed", {})}
    gtable, gmd = gc.build_table(payload)
    source = (f"gemm-configs-tune-shipped-{tables.device_key(device_name)}-{payload['environment']['date']}"
              if plan.shapes == "shipped" else None)
    gtable.update(source=f"{source}.json" if source else "tp-overlap tune", command=plan.command)
    gpath = tables.write("gemm", device_name, None, gtable)
    # the results the table is made of (gemm_configs.build_table makes it again of them alone)
    files.write_atomic(store_dir(device_name, world, "gemm_configs") / "gemm-configs-results.json",
                        json.dumps(payload, indent=1))
    if source:
        stem = tables.cache_dir() / "evidence" / source
        files.write_atomic(stem.with_suffix(".json"), json.dumps(payload, indent=1))
        files.write_atomic(stem.with_suffix(".md"), header(payload["environment"]) + gmd)
    return gpath, gmd


def write_decode_table(device_name: str, world: int, plan: Plan) -> tuple[Path, str] | None:
    """The decode matmul's config table of the decode_configs phase's stored rows into the cache
    (naming the plan's command, the one that measures it again); its path and markdown (None: nothing
    measured)."""
    from tp_overlap_plugin.tuning import decode_configs as dc
    stored = load_phase(device_name, world, "decode_configs")
    if not stored or not stored["rows"]:
        return None
    rows = [e for e in stored["rows"].values() if "row_failed" not in e]
    env = {**stored["environment"], "date": datetime.date.today().isoformat()}
    path = tables.write("decode", device_name, None,
                        dc.build_table(rows, stored.get("candidates", {}), env, plan.command))
    return path, dc.markdown(rows, timed="one eager call, CPU" if device_name == "cpu" else "CUDA graphs")


def _header(table: dict, plan: Plan) -> str:
    return (f"# tp-overlap tune: {table['device']}, TP={table['world']}\n\n"
            f"Measured {table['date']} under torch {table['torch']}, Triton {table['triton']}, driver "
            f"{table.get('driver')}; models {', '.join(table.get('models', [])) or plan.model}. Each row was timed "
            f"in {plan.repeats} interleaved repeat(s); ours is chosen only where it won by {table['margin']}x in every "
            f"repeat. Ratios are stock/ours, median [min–max] over the repeats.\n\nRegenerate: `{table['command']}`.\n\n")


def _shipped_header(env: dict, plan: Plan) -> str:
    return (f"# tp-overlap tune: the config tables of {env['device']}, every shipped model's shapes\n\n"
            f"Measured {env['date']} under torch {env['torch']}, Triton {env['triton']}, driver {env.get('driver')}: "
            f"{plan.describe()}.\n\nRegenerate: `{plan.command}`.\n\n")


def run_markdown(plan: Plan, summary: dict) -> str:
    """This run's wall time per phase, against the plan's estimate (bench/notes/tune.md: the cost
    model, items x seconds per item, that estimates a run at another TP size from these)."""
    from tp_overlap_plugin.tuning.results import md_table
    est = plan.phase_estimates_s()
    phases = summary["phases"]
    rows = [[p, s["items"], s["resumed"], s["measured"], s["wall_s"],
             s["wall_s"] / s["measured"] if s["measured"] else "-", est.get(p, "-"),
             s["stopped"] or (f"both engines built in {s['build_s']:.0f} s" if "build_s" in s else "")]
            for p, s in phases.items()]
    rest = summary["wall_s"] - sum(s["wall_s"] for s in phases.values())
    rows.append(["start: ranks, preflight, tables", "", "", "", rest, "", est["start"],
                 f"preflight {summary['preflight_s']:.0f} s" if "preflight_s" in summary else ""])
    return (f"\n# This run: wall time per phase (s)\n\nTP={plan.world}, {'quick' if plan.quick else 'full'}, "
            f"{summary['wall_s']:.0f} s in all. A single-GPU phase is shared out over the {plan.world} rank(s); the "
            f"engine phase's time includes building both engines.\n\n" + md_table(
                ["phase", "items", "kept from before", "measured", "wall", "per measured item", "estimated", "note"],
                rows))


def _norm_markdown(rows: list[dict]) -> str:
    from tp_overlap_plugin.tuning.results import md_table
    mode = "graph" if any("fused_graph_us" in r for r in rows) else "eager"
    out = (f"\n## Fused all-reduce + add + RMSNorm ({mode}, µs)\n\nAgainst an all-reduce followed by the add + norm "
           "kernel; the engine takes the fused kernel where our all-reduce is chosen.\n\n")
    return out + md_table(["hidden", "T", "fused", "ours then norm", "NCCL then norm", "NCCL+norm / fused"],
                          [[r["hidden"], r["tokens"], r.get(f"fused_{mode}_us"), r.get(f"ours_then_norm_{mode}_us"),
                            r.get(f"nccl_then_norm_{mode}_us"),
                            r.get(f"nccl_then_norm_{mode}_us", float("nan")) / r.get(f"fused_{mode}_us", float("nan"))]
                           for r in sorted(rows, key=lambda r: (r["hidden"], r["tokens"]))])


def _chart(table: dict, path: Path) -> str | None:
    """Every row's ratio stock/ours with its spread over the repeats, per section; None without
    matplotlib."""
    from tp_overlap_plugin.tuning.results import pyplot
    plt = pyplot()
    if plt is None:
        return None
    sections = [("GEMV vs F.linear", [(f"{r['shape']} M={r['M']}", r.get("ratio"), r["winner"] != "stock",
                                       r["cublas_us"] / r["gemv_us"]) for r in table.get("gemv", [])]),
                ("AG/RS vs sequential", [(f"{r['op']} M={r['M']} {r['K']}x{r['N']}", r.get("ratio"),
                                          r["winner"] != "stock", r["speedup"]) for r in table["gemm"]]),
                ("all-reduce vs NCCL (graph)", [(f"{r['bytes'] >> 10} KB", r.get("graph_ratio"),
                                                 r["graph_winner"] != "stock",
                                                 (r["nccl_graph_us"] or 0) / (r["ours_graph_us"] or 1))
                                                for r in table["all_reduce"]]),
                ("GEMM+AR vs best stock (graph)", [(f"{r['shape']} M={r['M']}", r.get("graph_ratio"),
                                                    r["graph_winner"] != "stock",
                                                    (r["graph_best_stock_us"] or 0) / (r["graph_us"] or 1))
                                                   for r in table.get("gemm_all_reduce", [])])]
    sections = [(t, rows) for t, rows in sections if rows]
    if not sections:
        return None
    fig, axes = plt.subplots(len(sections), 1, figsize=(max(8, 0.3 * max(len(r) for _, r in sections)),
                                                        3.2 * len(sections)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], sections):
        xs = range(len(rows))
        med = [r[1][1] if r[1] else r[3] for r in rows]
        err = [[m - (r[1][0] if r[1] else m) for m, r in zip(med, rows)],
               [(r[1][2] if r[1] else m) - m for m, r in zip(med, rows)]]
        ax.bar(xs, [m - 1 for m in med], bottom=1, color=["tab:green" if r[2] else "tab:gray" for r in rows], alpha=0.6)
        ax.errorbar(xs, med, yerr=err, fmt="o", color="black", capsize=3, markersize=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(table["margin"], color="tab:green", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), [r[0] for r in rows], rotation=60, ha="right", fontsize=6)
        ax.set_title(f"{title}: stock/ours, median and min-max over repeats (green: ours chosen)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def drop_empty_sections(md: str) -> str:
    """The evidence without headings that have nothing under them: a heading whose next non-blank line
    is a heading of its level or above, or the end (a CPU smoke run leaves whole tables empty). Repeated,
    since dropping a section's last subsection empties the section."""
    while True:
        lines = md.split("\n")
        keep = []
        for i, line in enumerate(lines):
            level = len(line) - len(line.lstrip("#"))
            if level and line[level:level + 1] == " ":
                nxt = next((x for x in lines[i + 1:] if x.strip()), None)
                nlevel = 0 if nxt is None else len(nxt) - len(nxt.lstrip("#"))
                if nxt is None or (nlevel and nxt[nlevel:nlevel + 1] == " " and nlevel <= level):
                    continue
            keep.append(line)
        out = "\n".join(keep)
        if out == md:
            return md
        md = out
