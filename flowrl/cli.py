"""The `flowrl` command line: check, compile, show, run, eval, export, viz, timeline, fuse-schedule, and the simulator's
simulate, calibrate and plan (flowrl.backends.sim.commands).

Every user error is printed as a rendered diagnostic on stderr with exit status 1; no verb prints a
Python traceback for a mistake in a flow, data file or reward function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.backends import entries as backend_entries
from flowrl.backends import names as backend_names
from flowrl.backends.sim import commands as sim_commands
from flowrl.errors import Diagnostic, FlowError

if TYPE_CHECKING:
    from flowrl.dsl.stages import Pipeline
    from flowrl.ir.graph import Graph


def _fmt(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowrl", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write RLHF algorithms as dataflow programs; compile, inspect and run them.",
        epilog=_fmt("""
            examples:
              flowrl check examples/grpo_arith.flow
              flowrl compile examples/ppo_arith.flow --explain
              flowrl run examples/grpo_arith.flow --steps 50 --out runs/grpo
        """),
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {example}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    c = verb("check", "Check flow files; exit 0 when all are valid (warnings are printed and don't fail).",
             "flowrl check examples/*.flow --backend process")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--backend", default=None, choices=backend_names(),
                   help="the backend it will run on: what the flow asks for and that backend can't do is a warning")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a flow key, as `run` will (checked with the override applied)")

    c = verb("compile", "Compile a flow and print its graph (text, or JSON with --json).",
             "flowrl compile examples/grpo_arith.flow --json --no-pass share-prefix")
    c.add_argument("file", metavar="FILE")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--passes", help="comma-separated passes to run instead of the defaults")
    c.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch a pass off")
    c.add_argument("--pass", dest="with_pass", action="append", default=[], metavar="NAME",
                   help="switch on a pass that is off by default (score-tail)")
    c.add_argument("--explain", action="store_true", help="say what each pass changed and why")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a flow key")

    c = verb("show", "Print a standard-library template's source.", "flowrl show grpo")
    c.add_argument("name", metavar="NAME", nargs="?", help="template name (omit to list them, a line on each)")

    c = verb("run", "Train: run a flow for some steps and write a run directory.",
             "flowrl run examples/grpo_arith.flow --steps 60 --set actor.lr=3e-3 --out runs/grpo")
    c.add_argument("file", metavar="FILE")
    c.add_argument("--backend", default="local", choices=backend_names(),
                   help="where it runs: " + "; ".join(f"{e.name}: {e.help}" for e in backend_entries().values())
                        + " (ranks per group: each model's `replicas`, e.g. --set actor.replicas=2)")
    c.add_argument("--address", default=None, help="Ray cluster address (ray and serverless backends); default: start one")
    c.add_argument("--steps", type=int, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--device", default=None, help="auto | cpu | cuda (default: run { device })")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override MODEL.KEY, DATA.KEY, REWARD.KEY, run.KEY, use.PARAM or eval.NAME.KEY; in a flow "
                        "with stages also stage.NAME.KEY (a run key of one stage) or stage.NAME.use.PARAM")
    c.add_argument("--out", default=None, metavar="DIR", help="run directory (default runs/<flow>)")
    c.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    c.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    c.add_argument("--passes", help="comma-separated passes to run instead of the defaults")
    c.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch a pass off")
    c.add_argument("--pass", dest="with_pass", action="append", default=[], metavar="NAME",
                   help="switch on a pass that is off by default (score-tail)")
    c.add_argument("--quiet", action="store_true", help="no progress bar, nor the flow's opening comment")
    c.add_argument("--stage", default=None, metavar="NAME",
                   help="a flow with stages: run only this one, from the earlier stages' models saved in --out")
    c.add_argument("--log", default=None, metavar="NAMES",
                   help="experiment trackers, comma-separated: wandb, mlflow, tensorboard (replaces run { log }; "
                        "WANDB_MODE=offline needs no network)")

    c = verb("eval", "Evaluate a run's policy on held-out prompts: mean@K, pass@k, maj@K (as an `eval` block does).",
             "flowrl eval runs/grpo --data data/test.jsonl --reward flowrl.rewards.arith_exact --n 4 --temperature 1")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("--data", required=True, metavar="FILE", help="prompts: JSONL, parquet or a datasets directory")
    c.add_argument("--reward", default=None, metavar="MODULE.FN",
                   help="a registered reward or a dotted path (default: the flow's eval block's, else its reward)")
    c.add_argument("--step", type=int, default=None, metavar="S",
                   help="the checkpoint of step S (default: the last; a pipeline's run: pipeline-wide steps)")
    c.add_argument("--init", action="store_true", help="evaluate the step-0 weights")
    c.add_argument("--model", default=None, metavar="NAME", help="the policy (default: the one the flow evaluates)")
    c.add_argument("--n", type=int, default=None, metavar="K", help="answers per prompt (default 1, or the eval block's)")
    c.add_argument("--temperature", type=float, default=None, metavar="T", help="0 answers greedily (the default)")
    c.add_argument("--max-tokens", type=int, default=None, metavar="M", help="default: the flow's generate's")
    c.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's device)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--samples", default=None, metavar="OUT.jsonl", help="write every answer with its reward")

    c = verb("viz", "Draw a flow's graph with graphviz (.svg, .png, .pdf or .dot).",
             "flowrl viz examples/ppo_arith.flow -o ppo.svg --stage placed")
    c.add_argument("file", metavar="FILE")
    c.add_argument("-o", "--output", required=True, metavar="OUT")
    c.add_argument("--stage", default="optimized", choices=["parsed", "optimized", "placed"])
    c.add_argument("--timings", default=None, metavar="RUN_DIR", help="colour nodes by their share of step time")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a flow key")

    c = verb("timeline", "Draw a Gantt chart of node spans per worker group from a run's trace.json.",
             "flowrl timeline runs/grpo -o timeline.png")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("-o", "--output", required=True, metavar="OUT.png")
    c.add_argument("--steps", type=int, default=3, help="how many of the last steps to draw")
    c.add_argument("--stage", default=None, metavar="NAME",
                   help="a pipeline's run: draw this stage's (default: every stage's, to OUT-NAME.png each)")

    c = verb("export", "Write a run's model as a Hugging Face directory (config.json, model.safetensors, tokenizer "
             "files, generation_config.json) that transformers loads without flowrl.",
             "flowrl export runs/grpo -o runs/grpo-hf")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("-o", "--output", required=True, metavar="DIR")
    c.add_argument("--model", default=None, metavar="NAME",
                   help="the model to export (default: the policy the run trains); a critic or reward model is "
                        "written as a one-label ...ForSequenceClassification")
    c.add_argument("--step", type=int, default=None, metavar="S",
                   help="the checkpoint of step S (default: the last; in a pipeline's run, the stage's own step)")
    c.add_argument("--stage", default=None, metavar="NAME",
                   help="a pipeline's run: this stage's checkpoints (default: the last stage that holds the model)")
    c.add_argument("--overwrite", action="store_true", help="replace the model directory DIR already holds")
    c.add_argument("--adapter", action="store_true",
                   help="a LoRA model: write its adapters as a peft adapter directory (default: merged into the base)")

    c = verb("fuse-schedule", "Schedule two models' pipelined training side by side on the same nodes (RLHFuse "
             "intra-stage fusion): greedy, then simulated annealing for makespan, then for peak memory.",
             "flowrl fuse-schedule --pp 4,2 --microbatches 8,8 --fwd 1,0.5 --json")
    c.add_argument("--pp", required=True, metavar="A,B", help="pipeline stages of model 0 and model 1 (B divides A)")
    c.add_argument("--microbatches", required=True, metavar="M0,M1", help="micro-batches per model per step")
    c.add_argument("--fwd", required=True, metavar="F0,F1", help="forward time per stage (a backward takes 2x)")
    c.add_argument("--mem", default="1,1", metavar="P0,P1", help="activation memory of one micro-batch on a stage")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--iters", type=int, default=None, help="annealing moves (default: 4 per task, at most 4000)")
    c.add_argument("--json", action="store_true", help="print the schedule as JSON")

    sim_commands.add_verbs(verb)
    return p


def compile_args(args: argparse.Namespace, extra: dict[str, str] | None = None) -> Graph | Pipeline:
    """The graph (a pipeline, for a flow with stages) `flowrl compile` / `flowrl run` build from their FILE, --set
    and pass options; `extra` overrides on top of --set."""
    from flowrl.compiler import compile_any, parse_sets

    passes = [p for p in args.passes.split(",") if p] if args.passes is not None else None
    return compile_any(args.file, {**parse_sets(args.set), **(extra or {})}, passes=passes, no_pass=args.no_pass,
                       with_pass=args.with_pass)


def _explain(graph: Graph) -> str:
    from flowrl.passes import REGISTRY

    docs = {p.name: p.doc for p in REGISTRY}
    lines = []
    for rec in graph.passes:
        lines.append(f"pass {rec.name}: {'changed the graph' if rec.changed else 'no change'} — {docs.get(rec.name, '')}")
        lines.extend(f"  - {note}" for note in rec.notes)
    return "\n".join(lines) if lines else "no passes ran"


def cmd_check(args: argparse.Namespace) -> int:
    from flowrl import cli_stages
    from flowrl.compiler import optimize, parse_sets
    from flowrl.dsl import load_any
    from flowrl.dsl.stages import Pipeline

    failed, sets = 0, parse_sets(args.set)
    for f in args.files:
        try:
            graph = load_any(f, sets)
        except FlowError as e:
            print(e.render(), file=sys.stderr)
            failed += 1
        else:
            if isinstance(graph, Pipeline):
                cli_stages.check(f, graph, _settings_not_applied,
                                 partial(_backend_warnings, backend=args.backend) if args.backend else None)
                continue
            print(f"{f}: ok")
            for w in graph.warnings:
                print(w.render(), file=sys.stderr)
            optimized = optimize(graph)
            for note in _settings_not_applied(optimized):
                print(f"{f}: note: {note}")
            if args.backend is not None:
                for w in _backend_warnings(optimized, args.backend):
                    print(f"{f}: {w.render()}", file=sys.stderr)
            else:
                for note in _async_notes(optimized):  # on stderr with the warnings: about where it runs
                    print(f"{f}: note: {note}", file=sys.stderr)
    return 1 if failed else 0


def _staleness(graph: Graph) -> int:
    """The `max_staleness` of an asynchronous graph (pass async-rollout applied), else 0."""
    return max((int(str(n.attrs.get("max_staleness", 0) or 0)) for n in graph.nodes if n.op == "generate"),
               default=0)


def _why_not_async(backend: str) -> str:
    """Why `backend` cannot overlap generation with training ("" when it can): its class says so."""
    import importlib

    module, _, attr = backend_entries()[backend].target.partition(":")
    return str(getattr(getattr(importlib.import_module(module), attr), "why_not_async", ""))


def _backend_warnings(graph: Graph, backend: str) -> list[Diagnostic]:
    """What `graph` asks for that `backend` cannot do: an asynchronous flow on a backend that can't overlap."""
    k = _staleness(graph)
    why = _why_not_async(backend) if k else ""
    if not why:
        return []
    able = [n for n, e in backend_entries().items() if n != backend and (e.extra or not _why_not_async(n))]
    return [Diagnostic(f"run {{ max_staleness = {k} }} is not applied on the {backend} backend, the run is "
                       f"synchronous: {why}", hint="run it with --backend " + (", ".join(able[:-1]) + " or " + able[-1] if len(able) > 1
                                                         else "".join(able)),
                       severity="warning")]


def _async_notes(graph: Graph) -> list[str]:
    """Without --backend: the backends an asynchronous flow runs synchronously on. Backends with an extra (Ray)
    are not imported to ask: they hold their own copies of the models."""
    k = _staleness(graph)
    if not k:
        return []
    sync = [n for n, e in backend_entries().items() if not e.extra and _why_not_async(n)]
    return [f"run {{ max_staleness = {k} }} overlaps generation with training on the "
            f"{', '.join(n for n in backend_entries() if n not in sync)} backends; on {' and '.join(sync)} the run "
            "is synchronous (`flowrl check --backend NAME` says which applies)"] if sync else []


def _settings_not_applied(graph: Graph) -> list[str]:
    """What a valid flow asks for that its compiled graph cannot do, and why (the passes' refusals)."""
    asked = int(str(graph.run.get("max_staleness", 0) or 0))
    refusals = [n for rec in graph.passes if rec.name == "async-rollout" for n in rec.notes
                if n.startswith("synchronous: ")]
    return [f"run {{ max_staleness = {asked} }} is not applied, the run is synchronous: "
            f"{n.removeprefix('synchronous: ')}" for n in refusals]


def cmd_compile(args: argparse.Namespace) -> int:
    from flowrl import cli_stages
    from flowrl.dsl.stages import Pipeline
    from flowrl.ir import to_json_text, to_text

    graph = compile_args(args)
    if isinstance(graph, Pipeline):
        print(cli_stages.compile_text(graph, args.json, _explain if args.explain else None))
        return 0
    print(to_json_text(graph) if args.json else to_text(graph), end="\n" if args.json else "")
    if args.explain:
        print(_explain(graph), file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from flowrl.dsl import stdlib_names, template_source, template_summary

    if not args.name:  # a line on each, from its file's opening comment
        width = max(map(len, stdlib_names()), default=0)
        print("\n".join(f"{n:<{width}}  {template_summary(n)}".rstrip() for n in stdlib_names()))
        return 0
    if args.name not in stdlib_names():
        raise FlowError(f"no standard template named '{args.name}' (templates: {', '.join(stdlib_names())})")
    print(template_source(args.name), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import flowrl
    from flowrl import backends, cli_stages
    from flowrl.dsl.stages import Pipeline
    from flowrl.runtime import interrupt
    from flowrl.runtime.progress import Progress, summary

    interrupt.install()

    for flag, value, least in (("--steps", args.steps, 1), ("--seed", args.seed, 0)):
        if value is not None and value < least:  # the run block's own limits (flowrl.ir.signatures.KEY_LIMITS)
            raise FlowError(Diagnostic(f"{flag} must be at least {least}, got {value}"))

    extra = _log_override(args.log)
    graph = compile_args(args, extra)
    if not args.quiet:  # what the flow says to expect of it (its opening comment), before the first step
        _say_what_to_expect(args.file)
    if isinstance(graph, Pipeline) and args.steps is not None:  # every stage's steps, as --set run.steps would
        graph = compile_args(args, {**extra, "run.steps": str(args.steps)})
    out = Path(args.out or Path("runs") / graph.flow)
    args.crash_dir = out  # where a flowrl bug's crash log goes (main), now that the run has a directory
    if args.device is not None:
        from flowrl.models.sources import device_problem

        problem = device_problem(args.device)
        if problem is not None:
            raise FlowError(Diagnostic(f"--device: {problem[0]}", hint="--device takes auto, cpu, cuda or cuda:N"))
    takes = backends.entries()[args.backend].options
    if args.address is not None and "address" not in takes:
        raise FlowError(Diagnostic(f"--address is for a backend on a cluster; the {args.backend} backend runs here",
                                   hint="use --backend ray --address HOST:PORT"))

    def options(where: Path) -> dict[str, Any]:
        offered = {"address": args.address, "log_dir": str(where / args.backend)}
        return {k: v for k, v in offered.items() if k in takes}

    if isinstance(graph, Pipeline):  # a backend per stage, each logging under its stage's directory
        return cli_stages.run(args, graph, out, lambda g: _backend_warnings(g, args.backend), options)
    if args.stage is not None:
        raise FlowError(Diagnostic("--stage runs one stage of a flow with `stage` blocks; this flow has none"))
    for w in [*graph.warnings, *_backend_warnings(graph, args.backend)]:  # before the first step
        print(w.render(), file=sys.stderr)
    total = args.steps if args.steps is not None else int(str(graph.run.get("steps", 100)))
    with Progress(total, enabled=not args.quiet, every=int(str(graph.run.get("log_every", 10) or 10))) as bar:
        result = flowrl.run(graph, out_dir=out, backend=args.backend, backend_options=options(out), steps=args.steps,
                            seed=args.seed, resume=args.resume, overwrite=args.overwrite, device=args.device,
                            on_step=bar.update)
    last = result.metrics[-5:]
    for note in _settings_not_applied(graph):
        print(f"note: {note}", file=sys.stderr)
    if last:
        print(f"done: {result.steps} steps, {summary(last)}; outputs in {out}")
    if result.cost:
        from flowrl.runtime.cost import table

        print(table(result.cost))
    return 0


def _say_what_to_expect(path: str) -> None:
    from flowrl.dsl import leading_comment

    lines = leading_comment(Path(path).read_text(encoding="utf-8"))
    if lines:
        print("\n".join(f"# {line}".rstrip() for line in lines), file=sys.stderr, flush=True)


def _log_override(text: str | None) -> dict[str, str]:
    """`--log wandb,mlflow` as the override `run.log = ["wandb", "mlflow"]`; an unknown name is an error."""
    if text is None:
        return {}
    from flowrl.dsl.diagnostics import did_you_mean
    from flowrl.ir.signatures import LOGGERS

    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in LOGGERS:
            raise FlowError(Diagnostic(f"--log: unknown tracker '{name}'",
                                       hint=did_you_mean(name, LOGGERS) or f"trackers: {', '.join(LOGGERS)}"))
    return {"run.log": "[" + ", ".join(json.dumps(n) for n in names) + "]"}


def cmd_eval(args: argparse.Namespace) -> int:
    from flowrl.runtime.eval_run import evaluate

    got = evaluate(args.run_dir, data=args.data, reward=args.reward, step=args.step, model=args.model, n=args.n,
                   temperature=args.temperature, max_tokens=args.max_tokens, init=args.init, samples=args.samples,
                   device=args.device)
    if got.left_out is not None:
        print(f"warning: {got.left_out}", file=sys.stderr)
    if args.json:
        print(json.dumps(got.summary()))
        return 0
    weights = "step-0 weights" if got.checkpoint is None else f"step {got.step}"
    stage = f" (stage {got.stage})" if got.stage is not None else ""
    print(f"{args.run_dir}: {got.model} at {weights}{stage}; {got.rows} prompts of {got.data} x {got.n}, "
          f"reward {got.reward}")
    width = max(len(k) for k in got.metrics)
    for key, value in got.metrics.items():
        print(f"  {key:<{width}}  {value:.4f}")
    if args.samples:
        print(f"samples: {args.samples}")
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from flowrl.viz import render

    render(args.file, args.output, stage=args.stage, timings=args.timings, sets=args.set)
    print(f"wrote {args.output}")
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from flowrl.viz.timeline import timeline

    if (Path(args.run_dir) / "pipeline.json").exists():
        from flowrl import cli_stages

        for path in cli_stages.timeline(Path(args.run_dir), args.output, args.stage, args.steps):
            print(f"wrote {path}")
        return 0
    if args.stage is not None:
        raise FlowError(Diagnostic(f"--stage picks a stage of a pipeline's run; {args.run_dir} holds one run "
                                   "(no pipeline.json)"))
    timeline(args.run_dir, args.output, last_steps=args.steps)
    print(f"wrote {args.output}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from flowrl.runtime.export_run import export_run

    found, done = export_run(args.run_dir, args.output, model=args.model, step=args.step, stage=args.stage,
                             overwrite=args.overwrite, adapter=args.adapter)
    where = f"stage {found.stage}, " if found.stage is not None else ""
    print(f"wrote {done.path}: `{found.model}` ({where}step {found.step}) as {done.architecture}, {done.dtype}")
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _pair(text: str, what: str, kind: type[int] | type[float]) -> tuple[Any, Any]:
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return (kind(parts[0]), kind(parts[1]))
    except ValueError:
        raise FlowError(Diagnostic(f"{what}: expected two {kind.__name__} values as X,Y, got {text!r}")) from None


def cmd_fuse_schedule(args: argparse.Namespace) -> int:
    from flowrl.planner.fuse_schedule import Problem, solve

    try:
        a, b = _pair(args.pp, "--pp", int)
        problem = Problem(a, b, _pair(args.microbatches, "--microbatches", int), _pair(args.fwd, "--fwd", float),
                          _pair(args.mem, "--mem", float))
    except ValueError as e:
        raise FlowError(Diagnostic(f"fuse-schedule: {e}")) from None
    result = solve(problem, seed=args.seed, iters=args.iters)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"makespan {result.makespan:g} (lower bound {result.lower_bound:g}, greedy {result.greedy_makespan:g}); "
          f"peak memory per node {[round(m, 6) for m in result.peak_memory]}")
    for n, tasks in enumerate(result.schedule):
        print(f"node {n}: " + " ".join(f"{t.kind}{t.model}.{t.copy}.{t.mb}" for t in tasks))
    return 0


VERBS = {"check": cmd_check, "compile": cmd_compile, "show": cmd_show, "run": cmd_run, "eval": cmd_eval, "viz": cmd_viz,
         "timeline": cmd_timeline, "fuse-schedule": cmd_fuse_schedule, **sim_commands.VERBS}
VERBS["export"] = cmd_export


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return VERBS[args.verb](args)
    except FlowError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flowrl: interrupted (checkpoints written so far are kept; continue with --resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `flowrl run ... 2>&1 | head`: the reader is gone; stop as Unix tools do
        _closed_output()
        return 141  # 128 + SIGPIPE
    except Exception as e:  # a flowrl bug: say so plainly, keep the details in a file rather than the screen
        log = _crash_log(getattr(args, "crash_dir", None), traceback.format_exc())
        print(f"flowrl: internal error: {type(e).__name__}: {e}\n(details in {log}; please report it)",
              file=sys.stderr)
        return 2


def _crash_log(folder: Path | None, text: str) -> Path:
    """A new file holding `text`: in the run's directory for `run` (else the temporary folder), never the working
    directory, never over an earlier crash's log."""
    import tempfile

    where = folder if folder is not None else Path(tempfile.gettempdir())
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="flowrl-crash-", suffix=".log", dir=where)
    except OSError:
        fd, name = tempfile.mkstemp(prefix="flowrl-crash-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(name)


def _closed_output() -> None:
    """Say why the run stopped where that can still be read, then point stdout and stderr at /dev/null so the
    interpreter's last flush does not fail again on the closed pipe."""
    try:
        print("flowrl: output closed; stopped (checkpoints written so far are kept; continue with --resume)",
              file=sys.stderr, flush=True)
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # not a real file (captured in tests): nothing to flush into a pipe
            pass


if __name__ == "__main__":
    sys.exit(main())
