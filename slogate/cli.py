"""The `slogate` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="slogate: SLO-aware OpenAI-compatible gateway")
console = Console(stderr=True)


@app.callback()
def _main() -> None:
    """slogate command line."""


def _floats(spec: str) -> list[float]:
    try:
        return [float(x) for x in spec.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"expected comma-separated numbers, got {spec!r}") from e


@app.command()
def simulate(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="trace_*.csv: arrival_s,input_tokens,output_tokens; or a prefix trace *.jsonl with hash_ids")],
    workflows: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="workflows_*.jsonl for compound requests")] = None,
    mix: Annotated[str, typer.Option(help="SLO class mix, e.g. latency=1,deadline=1,compound=1,best_effort=0")] = "latency=1,deadline=1,compound=1",
    tiers: Annotated[str, typer.Option(help="tiers as NAME=WEIGHT:SHARE,...")] = "high=2:0.5,low=1:0.5",
    slo_scale: Annotated[float, typer.Option(help="multiply every default SLO by this")] = 1.0,
    replicas: Annotated[int, typer.Option(min=1)] = 8,
    rate_scale: Annotated[str, typer.Option(help="arrival-rate multiplier(s), comma-separated for a load sweep")] = "1.0",
    duration_s: Annotated[float | None, typer.Option(help="only arrivals in the first S seconds (after scaling)")] = None,
    max_requests: Annotated[int | None, typer.Option(help="stop after this many LLM calls")] = None,
    policies: Annotated[str, typer.Option(help="ORDERING+PLACEMENT[-noindex][@BUDGET],... e.g. gmax+gorouting,fcfs+cache-aware@256")] = "gmax+gorouting,fcfs+least-load",
    predictor: Annotated[str, typer.Option(help="oracle | noisy | mean | qrf")] = "mean",
    predictor_model: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="for --predictor qrf: a train-predictor model file")] = None,
    prompts: Annotated[str | None, typer.Option(help="for qrf: prompts_*.jsonl to pair requests with (default: those beside the trace)")] = None,
    stage_estimate: Annotated[str | None, typer.Option(help="workflow sub-deadlines: whole (none: every call gets the workflow deadline) | uniform | pattern | oracle (default: pattern; oracle with --predictor oracle)")] = None,
    budget: Annotated[int, typer.Option(min=1, help="gateway's per-replica concurrency budget")] = 48,
    learn_budget: Annotated[bool, typer.Option(help="learn each replica's budget online as `slogate serve` does (--budget: the cap)")] = False,
    tokens_per_id: Annotated[int, typer.Option(min=1, help="prefix traces: prompt tokens per block hash id (the trace's own: 512)")] = 512,
    kv_capacity_tokens: Annotated[int, typer.Option(min=1, help="each engine's KV cache in tokens (bounds its prefix cache)")] = 400_000,
    workflow_prefix_tokens: Annotated[int, typer.Option(min=0, help="workflow calls resend the context so far: prefix blocks of this "
                                                        "many tokens (0: no prefix sharing)")] = 0,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write results JSON here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG of token goodput vs load")] = None,
) -> None:
    """Replay a trace through N simulated vLLM replicas under each policy combination."""
    from slogate.router.registry import parse_combo
    from slogate.sim.runner import Experiment, SimConfig

    combos = [c.strip() for c in policies.split(",") if c.strip()]
    try:
        for c in combos:
            parse_combo(c.partition("@")[0].removesuffix("-noindex"))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--policies") from e
    scales = _floats(rate_scale)
    cfg = SimConfig(str(trace), str(workflows) if workflows else None, mix, tiers, slo_scale, replicas, scales[0], duration_s, max_requests, predictor, seed, budget=budget,
                    learn_budget=learn_budget, predictor_model=str(predictor_model) if predictor_model else None, prompts=prompts,
                    stage_estimate=stage_estimate, tokens_per_id=tokens_per_id, kv_capacity_tokens=kv_capacity_tokens,
                    workflow_prefix_tokens=workflow_prefix_tokens)
    try:
        exp = Experiment(cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    rows: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task("simulating", total=len(scales) * len(combos))
        for s in scales:
            exp.cfg.rate_scale = s
            for c in combos:
                prog.update(task, description=f"x{s:g} {c}")
                try:
                    row = exp.run(c)
                except ValueError as e:
                    raise typer.BadParameter(str(e)) from e
                row["rate_scale"] = s
                rows.append(row)
                prog.advance(task)
    _print_table(rows)
    config = cfg.describe() | {"rate_scale": scales if len(scales) > 1 else scales[0], "policies": combos, "requests": rows[0]["requests"] if rows else 0}
    doc = {"config": config, "results": rows}
    if out:
        out.write_text(json.dumps(doc, indent=2))
    else:
        typer.echo(json.dumps(doc))
    if plot:
        _plot(rows, plot)


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")


def _print_table(rows: list[dict[str, Any]]) -> None:
    t = Table(title="slogate simulate")
    for col in ("load", "policy", "token goodput/s", "req goodput/s", "TDG", "att latency", "att deadline", "att compound", "att all", "TTFT p50", "TBT p95", "shed", "preempt", "prefix hit"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in rows:
        a = r["slo_attainment"]
        t.add_row(
            f"x{r['rate_scale']:g}", r["name"], _fmt(r["token_goodput"]), _fmt(r["request_goodput"]), _fmt(r["tdg_ratio"], True),
            _fmt(a.get("latency"), True), _fmt(a.get("deadline"), True), _fmt(a.get("compound"), True), _fmt(a.get("all"), True),
            _fmt(r["ttft_p50"]), _fmt(r["tbt_p95"]), str(r["shed"]), str(r["preempted"]), _fmt(r.get("prefix_hit_rate"), True),
        )
    Console(width=220).print(t)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["rate_scale"], r["token_goodput"]) for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("rate scale (× trace arrival rate)")
    ax.set_ylabel("token goodput (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    app()


def _progress_cb(prog: Progress, task: Any) -> Any:
    def cb(stage: str, frac: float) -> None:
        prog.update(task, description=stage, completed=round(frac * 100))

    return cb


def _data_files(spec: str) -> list[Path]:
    files = [Path(p.strip()) for p in spec.split(",") if p.strip()]
    missing = [str(p) for p in files if not p.is_file()]
    if not files or missing:
        raise typer.BadParameter(f"no such file(s): {', '.join(missing) or spec!r}", param_hint="--data")
    return files


@app.command("train-predictor")
def train_predictor(
    data: Annotated[str, typer.Option(help="prompts_*.jsonl file(s), comma-separated")],
    out: Annotated[Path, typer.Option(help="model file to write")],
    quantile: Annotated[float, typer.Option(min=0.5, max=0.99, help="quantile q of the remaining length to bound")] = 0.9,
    heldout: Annotated[float, typer.Option(min=0.0, max=0.9, help="share of prompts kept out of training (for eval-predictor)")] = 0.2,
    seed: int = 0,
) -> None:
    """Train the length upper-bound model (split by prompt; held-out prompts are recorded by rule)."""
    from slogate.predictors.evaluate import load_prompt_rows, split_rows
    from slogate.predictors.qrf import LengthModel

    files = _data_files(data)
    try:
        rows = load_prompt_rows(files)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--data") from e
    train, test = split_rows(rows, heldout)
    model = LengthModel(q=quantile)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task("loading", total=100)
        try:
            model.fit([r.prompt for r in train], [r.true_len for r in train], [r.prompt.text for r in train],
                      progress=_progress_cb(prog, task), seed=seed)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--data") from e
    model.meta.update({"heldout_fraction": heldout, "split_salt": "", "data": [f.name for f in files],
                       "train_rows": len(train), "heldout_rows": len(test)})
    size = model.save(out)
    console.print(f"trained on {len(train):,} rows ({len(test):,} held out) in {model.meta['train_s']} s; wrote {out} ({size / 1e6:.1f} MB)")


@app.command("eval-predictor")
def eval_predictor(
    model: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="a train-predictor model file")],
    data: Annotated[str, typer.Option(help="prompts_*.jsonl file(s), comma-separated")],
    out: Annotated[Path, typer.Option(help="report JSON to write")],
    all_rows: Annotated[bool, typer.Option("--all", help="evaluate on every row (data the model never saw), not only its held-out prompts")] = False,
) -> None:
    """Coverage, tightness and pinball loss of the bound on held-out prompts, vs baselines."""
    from slogate.predictors.evaluate import evaluate, load_prompt_rows, split_rows
    from slogate.predictors.qrf import LengthModel

    try:
        m = LengthModel.load(model)
        rows = load_prompt_rows(_data_files(data))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    frac = float(m.meta.get("heldout_fraction", 0.0))
    if all_rows:
        train, test = [], rows
    else:
        if frac <= 0:
            raise typer.BadParameter("the model was trained without held-out prompts; pass --all with data it never saw")
        train, test = split_rows(rows, frac, str(m.meta.get("split_salt", "")))
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task("evaluating", total=100)
        try:
            report = evaluate(m, train, test, progress=_progress_cb(prog, task))
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
    report["model_file_mb"] = round(model.stat().st_size / 1e6, 2)
    out.write_text(json.dumps(report, indent=2))
    t = Table(title=f"length bound q={report['quantile']} on {report['n']:,} held-out rows")
    for col in ("", "n", "cover@0", "mean ratio@0", "p50 ratio@0", "cover@100", "mean ratio@100", "pinball@0"):
        t.add_column(col)

    def add(name: str, d: dict[str, Any]) -> None:
        t.add_row(name, str(d.get("n", d.get("n_at_0", ""))), *[str(d.get(k, "")) for k in (
            "coverage_at_0", "mean_ratio_at_0", "p50_ratio_at_0", "coverage_at_100", "mean_ratio_at_100", "pinball_at_0")])

    add("model", report["model"])
    for k, v in report["baselines"].items():
        add(k, v)
    for s, d in report["by_source"].items():
        add(f"model · {s}", d)
    console.print(t)
    console.print(f"speed: {report['speed']}; wrote {out}")


@app.command("eval-graphs")
def eval_graphs(
    workflows: Annotated[str, typer.Option(help="workflows_*.jsonl file(s), comma-separated")],
    out: Annotated[Path | None, typer.Option(help="report JSON to write")] = None,
    sigma: Annotated[float, typer.Option(min=0.01, help="kernel width, in units of the store's attribute spread")] = 0.5,
    top_k: Annotated[int, typer.Option(min=1, help="matches averaged per estimate")] = 20,
) -> None:
    """Leave-one-out error of stage time shares from pattern-graph matching vs a uniform split
    and the JITServe-code matcher, as stages reveal; plus matching latency with 500 graphs."""
    from slogate.predictors.pattern_eval import evaluate_file, match_latency

    files = _data_files(workflows)
    report: dict[str, Any] = {"files": {}}
    t = Table(title="stage time-share error (mean absolute), leave-one-out")
    for col in ("file", "workflows", "method", "φ(s) MAE", "next-stage share MAE", "share MAE by revealed stages"):
        t.add_column(col)
    for f in files:
        try:
            r = evaluate_file(f, sigma=sigma, top_k=top_k)
        except (ValueError, KeyError) as e:
            raise typer.BadParameter(f"{f}: {e}", param_hint="--workflows") from e
        report["files"][f.name] = r
        for m in ("pattern", "uniform", "jitserve_code"):
            by = " ".join(f"{b}:{v['share_mae']}" for b, v in r[m]["by_revealed_stages"].items())
            t.add_row(f.name, str(r["workflows"]), m, str(r[m]["all"]["phi_mae"]), str(r[m]["all"]["share_mae"]), by)
    report["match_latency_500"] = match_latency(files)
    console.print(t)
    console.print(f"matching with {report['match_latency_500']['graphs']} stored graphs: p50 {report['match_latency_500']['p50_ms']} ms, "
                  f"p99 {report['match_latency_500']['p99_ms']} ms")
    if out:
        out.write_text(json.dumps(report, indent=2))


KNOBS = "Knobs (override the config file and SLOGATE_* variables)"  # the --help panel of serve's knob flags


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="gateway YAML config")] = None,
    backend: Annotated[list[str] | None, typer.Option(help="backend URL (repeatable); models are discovered from /v1/models")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    sim_engines: Annotated[int, typer.Option(help="with no config and no backend: simulated engines to start")] = 4,
    log_level: str = "info",
    ordering: Annotated[str | None, typer.Option(help="policies.ordering: gmax, fcfs, edf, sjf, ltr, plas, slide, priority, vtc, simulated-annealing (sa)",
                                                 rich_help_panel=KNOBS)] = None,
    placement: Annotated[str | None, typer.Option(help="policies.placement: gorouting, power-of-k (pok), least-load, round-robin, random, power-of-two (p2c), cache-aware, prefix-score, session-hash",
                                                  rich_help_panel=KNOBS)] = None,
    budget: Annotated[int | None, typer.Option(help="backends[].budget: requests kept in flight per replica at most",
                                               rich_help_panel=KNOBS)] = None,
    learn_budget: Annotated[bool | None, typer.Option("--learn-budget/--no-learn-budget", help="capacity.learn: learn each replica's "
                                                      "SLO-safe concurrency (budget stays the bound), or keep budget fixed",
                                                      rich_help_panel=KNOBS)] = None,
    pacing: Annotated[bool | None, typer.Option("--pacing/--no-pacing", help="pacing.enabled: the smoothing buffer for latency streams",
                                                rich_help_panel=KNOBS)] = None,
    ttft_ms: Annotated[float | None, typer.Option(help="slo.default.ttft_ms: default time to first token",
                                                  rich_help_panel=KNOBS)] = None,
    tbt_ms: Annotated[float | None, typer.Option(help="slo.default.tbt_ms: default time between tokens",
                                                 rich_help_panel=KNOBS)] = None,
    deadline_ms: Annotated[float | None, typer.Option(help="slo.default.deadline_ms: default deadline of a whole answer",
                                                      rich_help_panel=KNOBS)] = None,
    waiting_ms: Annotated[float | None, typer.Option(help="slo.default.waiting_ms: default longest wait for admission",
                                                     rich_help_panel=KNOBS)] = None,
    redis_url: Annotated[str | None, typer.Option(help="state.url (and state.kind redis): share replica state with other gateways",
                                                  rich_help_panel=KNOBS)] = None,
    prefix_index: Annotated[bool | None, typer.Option("--prefix-index/--no-prefix-index",
                                                      help="prefix.enabled: place by where each replica's prefix cache is",
                                                      rich_help_panel=KNOBS)] = None,
    tokenizer: Annotated[str | None, typer.Option(help="prefix.tokenizer: the served model's Hugging Face tokenizer (directory or "
                                                  "tokenizer.json): prefix blocks of token ids, as the engine cuts them",
                                                  rich_help_panel=KNOBS)] = None,
    kv_events: Annotated[list[str] | None, typer.Option(help="backends[].kv_events: ZMQ endpoint of an engine's KV-cache events, one per "
                                                        "--backend in order (or one for all, `{host}` standing for each one's host)",
                                                        rich_help_panel=KNOBS)] = None,
) -> None:
    """Run the gateway. With no config and no backend: gateway + simulated engines, in-memory state.
    Precedence: flags, then SLOGATE_* environment variables, then the config file, then defaults."""
    import os

    from pydantic import ValidationError

    from slogate.embedded import run
    from slogate.gateway.config import GatewayConfig, apply_flags, load_config

    if config is None and os.environ.get("SLOGATE_CONFIG"):
        config = Path(os.environ["SLOGATE_CONFIG"])

    def flags(c: GatewayConfig) -> GatewayConfig:
        return apply_flags(c, backends=backend, ordering=ordering, placement=placement, budget=budget, learn_budget=learn_budget,
                           pacing=pacing, ttft_ms=ttft_ms, tbt_ms=tbt_ms, deadline_ms=deadline_ms, waiting_ms=waiting_ms,
                           redis_url=redis_url, prefix_index=prefix_index, tokenizer=tokenizer, kv_events=kv_events)

    def read() -> GatewayConfig:
        """The config as a reload reads it again: the file, then the environment, then these flags."""
        return flags(load_config(config))

    try:
        cfg = load_config(config)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--config") from e
    try:
        cfg = flags(cfg)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise typer.BadParameter(msgs) from e
    import contextlib
    import faulthandler
    import signal

    with contextlib.suppress(OSError, ValueError):  # stderr without a file descriptor (embedded, tests)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    import logging

    # The gateway's own loggers (slogate.*) follow --log-level too, not only uvicorn's.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("slogate").setLevel(log_level.upper())
    n_sim = sim_engines if not cfg.backends else 0
    if n_sim:
        console.print(f"no backend configured: starting {n_sim} simulated engines (model 'sim-model')")
    run(cfg, host, port, sim_engines=n_sim, log_level=log_level, sim_budget=budget, source=read, watch=config)


@app.command()
def reference(
    out_dir: Annotated[Path, typer.Option(help="where the reference files go")] = Path("docs/reference"),
    check: Annotated[bool, typer.Option(help="only check that the files are up to date (exit 1 if not)")] = False,
) -> None:
    """Write the configuration, metrics and SLO references generated from the code."""
    from slogate.gateway.reference import stale, write

    if check:
        bad = stale(out_dir)
        if bad:
            console.print(f"out of date in {out_dir}: {', '.join(bad)} (run `slogate reference`)")
            raise typer.Exit(1)
        console.print("references up to date")
        return
    for p in write(out_dir):
        console.print(f"wrote {p}")


@app.command("hash-key")
def hash_key(key: Annotated[str, typer.Argument(help="an API key (or '-' to read it from stdin)")]) -> None:
    """Print the SHA-256 to put in `auth.keys[].sha256` (the key itself is never stored)."""
    import sys

    from slogate.gateway.auth import key_hash

    print(key_hash(sys.stdin.readline().strip() if key == "-" else key))


@app.command()
def engine(
    port: int = 8001,
    host: str = "127.0.0.1",
    model: str = "sim-model",
    max_num_seqs: int = 64,
    time_scale: Annotated[float, typer.Option(help="> 1 slows every step down by this factor")] = 1.0,
    priority_scheduling: bool = False,
    kv_cache_tokens: Annotated[int, typer.Option(help="KV cache in tokens: what the prefix cache holds, and the running sequences' bound")] = 400_000,
    fixed_ttft_ms: Annotated[float | None, typer.Option(help="fixed-latency mode: first token after this long, whatever the load")] = None,
    fixed_itl_ms: Annotated[float, typer.Option(help="fixed-latency mode: time between tokens")] = 20.0,
    profile_file: Annotated[Path | None, typer.Option(help="a fitted profile (JSON with `coeffs`, e.g. bench/sim_vs_real.py "
                                                       "calibrate's) instead of the built-in one")] = None,
    max_batched_tokens: Annotated[int, typer.Option(help="tokens a step may hold (chunked prefill's budget)")] = 512,
    chars_per_token: Annotated[float, typer.Option(help="how a text prompt is counted in tokens")] = 4.0,
) -> None:
    """A simulated vLLM engine (OpenAI API, vLLM /metrics) whose token timing follows the batch latency model."""
    import uvicorn

    from slogate.sim.server import create_engine_app

    kw: dict[str, Any] = {"priority_scheduling": priority_scheduling, "chars_per_token": chars_per_token}
    if fixed_ttft_ms is None:
        kw.update(max_num_seqs=max_num_seqs, time_scale=time_scale, kv_capacity_tokens=kv_cache_tokens, max_batched_tokens=max_batched_tokens)
        if profile_file is not None:
            from slogate.router.latency import LatencyCoeffs

            kw["profile"] = LatencyCoeffs(**json.loads(profile_file.read_text())["coeffs"])
    uvicorn.run(create_engine_app(model, fixed_ttft_ms=fixed_ttft_ms, fixed_itl_ms=fixed_itl_ms, **kw),
                host=host, port=port, log_level="warning")
