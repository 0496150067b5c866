"""table.md of a Stackelberg run: Tables 3, 4, 5 and 7 beside the paper's numbers, the leader oracles,
sim-to-real and tool repair; names from the grid quoted (:func:`envs.cache.values.md_cell`)."""
from __future__ import annotations

from pathlib import Path

from envs.cache.atomic import atomic_write_text
from envs.published import STACKELBERG_SIM_TO_REAL, STACKELBERG_SURROGATE, STACKELBERG_TABLE4, STACKELBERG_TOOL_REPAIR
from envs.cache.values import md_cell, md_code

from .config import StackelbergConfig
from .evaluate import STRATEGIES


def _fmt_p(p) -> str:
    if p is None:
        return "-"
    if p != p:
        return "n/a"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def _oracle_table(res: dict) -> str:
    """The leader oracle section of table.md: U_L per session (se) and tokens per turn on fresh sessions."""
    oc = res["config"]["oracle"]
    lp = res.get("leader_profile") or {"name": "paper", "synthetic": False}
    tag = f"SYNTHETIC leader profile '{lp['name']}'; " if lp["synthetic"] else ""
    L = [f"\n## Leader oracles ({tag}U_L per session and tokens per turn on {oc['score_sessions']} fresh sessions; "
         f"best constant over a {oc['levels']}x{oc['levels']} grid of (q, alpha) and best (task, model) table, "
         f"both chosen on {oc['select_sessions']} other sessions)\n",
         "| Controller | Environment | Best constant (q, alpha) | Best constant | Best table | Learned (PPO) | Untrained | "
         "PPO - best constant (paired se) | PPO - best table (paired se) |", "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda o: f"{o['u_leader']:.3f} ({o['u_leader_se']:.3f}) / {o['tokens_per_turn']:.1f}"
    for kind, r in res.get("leader_oracle", {}).items():
        for mode, o in r.items():
            g, gt = o["learned"]["gap_to_constant"], o["learned"].get("gap_to_table")
            gt = f"{gt['mean']:+.3f} ({gt['se']:.3f})" if gt else "-"
            L.append(f"| {kind} | {mode} | {o['constant']['action']} | {cell(o['constant'])} | {cell(o['table'])} | "
                     f"{cell(o['learned'])} | {cell(o['untrained'])} | {g['mean']:+.3f} ({g['se']:.3f}) | {gt} |")
    return "\n".join(L)


def _follower_table(res: dict) -> str:
    """The follower section of table.md: GAIL's and BC's held-out imitation errors per controller and the
    repaired controller with each follower on grid replay (the Table 4 row and its ', BC follower' reference)."""
    if not res.get("training"):
        return ""
    ev = res["evaluation"]["large"]
    rows = {**ev["strategies"], **ev.get("reference", {})}
    L = ["\n## Followers: GAIL beside behaviour cloning (held-out mean absolute action error against the noise-free "
         f"expert; large run{', SYNTHETIC' if res['data']['synthetic'] else ''})\n",
         "| Controller | GAIL error (selected seed) | BC error (best seed) | GAIL / BC | Label noise | Constant action | "
         "Tok. / Q with GAIL | Tok. / Q with BC |", "|---|---|---|---|---|---|---|---|"]
    for kind, name in (("scalar", "Scalar+R"), ("task", "Task-aware+R")):
        tr = res["training"].get(kind)
        bc_row = rows.get(f"{name}, BC follower")
        if tr is None or bc_row is None:
            continue
        im = tr["imitation_error"]
        g, b = im["gail"][tr["follower_seed"]], min(im["bc"])
        cell = lambda r: f"{r['tokens_per_turn']:.1f} / {r['quality']:.3f}"  # noqa: E731
        L.append(f"| {kind} | {g:.4f} | {b:.4f} | {g / b:.2f}x | {im['label_noise']:.4f} | "
                 f"{im['constant_mean_action']:.4f} | {cell(rows[name])} | {cell(bc_row)} |")
    return "\n".join(L) if len(L) > 3 else ""


def leader_profile_record(cfg: StackelbergConfig) -> dict:
    """results.json's ``leader_profile``: the leader utility's profile name, whether it is SYNTHETIC, its weights."""
    s = cfg.session
    return {"name": cfg.leader_profile, "synthetic": cfg.synthetic_leader,
            "w_savings": list(s.leader_w_s_task) if s.leader_w_s_task is not None else s.leader_w_s,
            "w_quality": list(s.leader_w_q_task) if s.leader_w_q_task is not None else s.leader_w_q,
            "w_subsidy": s.leader_w_alpha}


def leader_profile_line(res: dict) -> str:
    """table.md's line naming a SYNTHETIC leader utility profile ('' for the paper's)."""
    lp = res.get("leader_profile") or {"name": "paper", "synthetic": False}
    if not lp["synthetic"]:
        return ""
    return (f"Leader utility: SYNTHETIC profile '{lp['name']}' (not the paper's): per task type, savings weight "
            f"{lp['w_savings']}, quality weight {lp['w_quality']}, subsidy cost {lp['w_subsidy']} "
            f"(docs/stackelberg.md, \"A leader profile where state feedback matters\").\n")


def write_table(path: Path, res: dict) -> None:
    syn = res["data"]["synthetic"]
    L = []
    label = "SYNTHETIC response grid (not real LLM data)" if syn else "real response grid"
    L.append(f"# Stackelberg resource governance (arXiv 2606.23026): results on a {label}\n")
    if leader_profile_line(res):
        L.append(leader_profile_line(res))
    L.append(f"Grid {md_code(res['data']['name'])} ({res['data']['n_cells']} cells, provenance {md_cell(res['data']['provenance'].get('kind'))}); "
             f"pipeline wall time {res['timing']['total_s']:.1f} s on {res['environment']['backend']}.\n")
    for key, title in (("paper_size", "paper size"), ("large", "large")):
        ev = res["evaluation"][key]
        L.append(f"\n## Table 4 ({title}: {ev['episodes']} episodes x {ev['turns']} turns, grid replay{', SYNTHETIC' if syn else ''})\n")
        L.append("| Policy | Tok./turn | Q | Eff. (Q/T x 1e3) | dTok vs Cons. | p tokens (Welch) | p quality (Welch) | Pareto | Paper Tok. / Q / Eff. |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for n in STRATEGIES:
            r = ev["strategies"][n]
            pt = STACKELBERG_TABLE4[n]
            L.append(f"| {n} | {r['tokens_per_turn']:.1f} | {r['quality']:.3f} | {r['efficiency']:.3f} | "
                     f"{100 * r['token_change_vs_conservative']:+.1f}% | {_fmt_p(r['p_tokens_vs_conservative'])} | "
                     f"{_fmt_p(r['p_quality_vs_conservative'])} | {'yes' if n in ev['pareto_front'] else 'no'} | "
                     f"{pt[0]} / {pt[1]} / {pt[2]} |")
        for n, r in ev.get("reference", {}).items():
            L.append(f"| *{n}* (reference) | {r['tokens_per_turn']:.1f} | {r['quality']:.3f} | {r['efficiency']:.3f} | "
                     f"{100 * r['token_change_vs_conservative']:+.1f}% | {_fmt_p(r['p_tokens_vs_conservative'])} | "
                     f"{_fmt_p(r['p_quality_vs_conservative'])} | - | - |")
    L.append(_oracle_table(res))
    L.append(_follower_table(res))
    ev = res["evaluation"]["large"]
    L.append(f"\n## Table 5 (per task, tokens / quality, large run{', SYNTHETIC' if syn else ''})\n")
    L.append("| Task | " + " | ".join(STRATEGIES) + " |")
    L.append("|---|" + "---|" * len(STRATEGIES))
    tasks = res["data"]["task_types"]
    for t in tasks:
        cells = []
        for n in STRATEGIES:
            pt = ev["strategies"][n]["per_task"].get(t)
            cells.append(f"{pt['tokens']:.0f} / {pt['quality']:.2f}" if pt else "-")
        L.append(f"| {md_cell(t)} | " + " | ".join(cells) + " |")
    L.append("\n## Table 7 (trap audit: c > 0.9 or p > 0.7 or u > 0.5; large run)\n")
    L.append("| Mode | Mean action [c, p, u] | Trap rate |")
    L.append("|---|---|---|")
    for n, a in res["trap_audit"].items():
        L.append(f"| {n} | {a['mean_action']} | {100 * a['trap_rate']:.1f}% |")
    s = res["surrogate"]
    L.append("\n## Table 3 (surrogate payoff oracle, held-out split)\n")
    L.append("| Quantity | Ours | Paper |")
    L.append("|---|---|---|")
    ps = STACKELBERG_SURROGATE
    L.append(f"| Samples (train / test) | {s['n_train']} / {s['n_test']} | {ps['n']} |")
    L.append(f"| Token R^2 (MAE) | {s['token_r2']:.3f} ({s['token_mae']:.1f} tokens) | {ps['token_r2']} ({ps['token_mae']}) |")
    L.append(f"| Quality R^2 (MAE) | {s['quality_r2']:.3f} ({s['quality_mae']:.3f}) | {ps['quality_r2']} ({ps['quality_mae']:.3f}) |")
    f = res["sim_to_real"]
    L.append("\n## Sim-to-real token fit (surrogate vs replay, every evaluated turn of the large run)\n")
    pf = STACKELBERG_SIM_TO_REAL
    L.append(f"T_corr = {f['a']:.4f} T_sim + {f['b']:.1f} (paper {pf['a']} T_sim + {pf['b']}); token r = {f['token_pearson_r']:.3f} "
             f"(paper {pf['token_pearson_r']}); quality r = {f['quality_pearson_r']:.3f} (paper {pf['quality_pearson_r']}); mean tokens sim {f['mean_tokens_sim']:.0f} "
             f"vs replay {f['mean_tokens_real']:.0f}.\n")
    tr = res["tool_repair"]
    L.append("## Coding-aware tool repair (large run, Scalar controller)\n")
    L.append(f"Low-tool miss rate on tasks that need tools: projection only {100 * tr['miss_rate_projection_only']:.1f}% -> "
             f"projection + tool repair {100 * tr['miss_rate_repaired']:.1f}% (paper {100 * STACKELBERG_TOOL_REPAIR['miss_rate_projection_only']:.1f}% -> "
             f"{100 * STACKELBERG_TOOL_REPAIR['miss_rate_repaired']:.1f}%); u_need-hat per task: {tr['u_need_hat']}.\n")
    pr = res["probes"]
    L.append("## Grid probes (measured vs paper target)\n")
    L.append("| Probe | Measured | Target |")
    L.append("|---|---|---|")
    for k, v in pr["measured"].items():
        tgt = pr["targets"].get(k)
        L.append(f"| {k} | {v:.3f} | {'' if tgt is None else f'{tgt:.3f}'} |")
    atomic_write_text(path, "\n".join(L) + "\n")
