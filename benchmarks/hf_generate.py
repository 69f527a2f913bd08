"""Tokens/s of transformers' generate() on a small Llama-style model: eager,
torch.compile and graphopt's levels, with and without device graphs.

Greedy decoding with `cache_implementation="static"`, the way a user calls it. Each
variant runs on its own copy of one randomly initialised model (same weights), with
its `forward` replaced (`m.forward = torch.compile(m.forward)`, `m.forward =
graphopt.optimize(m.forward, cfg)`). Every variant is warmed up first (compiles and
captures), then timed in interleaved rounds in one process, so drift on a shared
machine hits them alike. The table shows tokens/s (batch x new tokens per generate()
call) of the best round and the median, ratios of medians to eager and to
torch.compile's default, and whether the variant's greedy tokens equal eager's. A
JSON of the figures, and a plot when matplotlib is installed, go to --out.

    python benchmarks/hf_generate.py --threads 1
    python benchmarks/hf_generate.py --device cuda --hidden 1024 --layers 8 --heads 16 --kv-heads 8
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt

EAGER, COMPILE = "eager", "torch.compile"


def build_model(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate or 2 * args.hidden,
        max_position_embeddings=args.prompt_len + args.new_tokens,
        # generate() gets min_new_tokens, so it never stops at eos: every call
        # decodes exactly --new-tokens, whatever the random weights predict.
        bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.LlamaForCausalLM(config).eval()


def make_variants(args: argparse.Namespace, base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """name -> a copy of `base` (same weights) whose forward is that variant's."""
    def copy() -> torch.nn.Module:
        model = build_model(args).to(args.device)
        model.load_state_dict(base.state_dict())
        return model

    variants = {EAGER: base}
    compiled = {COMPILE: {}}
    if args.device.startswith("cuda"):
        compiled[f"{COMPILE} reduce-overhead"] = {"mode": "reduce-overhead"}
    for name, kwargs in compiled.items():
        model = variants[name] = copy()
        model.forward = torch.compile(model.forward, **kwargs)
    graphs_name = "host graphs" if args.device == "cpu" else "CUDA graphs"
    for level in (int(x) for x in args.levels.split(",")):
        for graphs in (False, True):
            config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=graphs,
                                                      cudagraph_capture_sizes=args.batch_sizes)
            model = variants[f"graphopt L{level}" + (f" + {graphs_name}" if graphs else "")] = copy()
            model.forward = graphopt.optimize(model.forward, config)
    return variants


def generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int,
             cache: transformers.StaticCache | None = None) -> torch.Tensor:
    """Greedy generate() with a static cache: a new one per call (what
    `cache_implementation="static"` does), or `cache`, emptied first."""
    if cache is None:
        kwargs: dict[str, Any] = {"cache_implementation": "static"}
    else:
        cache.reset()
        kwargs = {"past_key_values": cache}
    # disable_compile: on CUDA, generate() would otherwise compile the forward itself
    # for a static cache, eager variant included.
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, disable_compile=True, **kwargs)


def figures(args: argparse.Namespace, times: dict[tuple[str, int], list[float]],
            tokens: dict[tuple[str, int], torch.Tensor], names: list[str]) -> list[dict[str, Any]]:
    """One row per batch size and variant: tokens/s of the best and the median round,
    ratios of medians, and whether its tokens equal eager's."""
    rows = []
    for batch in args.batch_sizes:
        def per_s(name: str, pick: Callable = statistics.median) -> float:
            """Tokens/s of one round, picked from the µs per generate() (min: the best)."""
            return batch * args.new_tokens / (pick(times[name, batch]) * 1e-6)

        for name in names:
            rows.append({"batch": batch, "variant": name, "tokens_per_s_best": per_s(name, min),
                         "tokens_per_s_median": per_s(name), "vs_eager": per_s(name) / per_s(EAGER),
                         "vs_torch_compile": per_s(name) / per_s(COMPILE),
                         "tokens_match": torch.equal(tokens[name, batch], tokens[EAGER, batch]),
                         "ms_per_generate": [round(t / 1e3, 3) for t in times[name, batch]]})
    return rows


def notes(variants: dict[str, torch.nn.Module]) -> dict[str, dict[str, Any]]:
    """What each graphopt variant's report says about its device graphs and fallbacks."""
    found = {}
    for name, model in variants.items():
        report = getattr(model.forward, "report", None)
        if report is not None:
            r = report()
            found[name] = {"graphs": len(r.graphs), "captures": len(r.captures), "recaptures": r.recaptures,
                           "replays": r.replays, "recompiles": r.recompiles, "fallbacks": sorted(r.fallbacks)}
    return found


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"generate(), Llama-style: hidden {args.hidden}, {args.layers} layers, "
                        f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}, {args.new_tokens} new tokens",
                  caption=f"torch {torch.__version__} · transformers {transformers.__version__} · {args.device} · "
                          f"{args.threads} thread(s) · {args.rounds} interleaved rounds · ratios of medians · "
                          f"{'one cache reused' if args.reuse_cache else 'a new StaticCache'} per call")
    for column in ("batch", "variant", "tokens/s best", "tokens/s median", "vs eager", "vs torch.compile",
                   "tokens = eager"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["batch"]), row["variant"], f"{row['tokens_per_s_best']:.0f}",
                      f"{row['tokens_per_s_median']:.0f}", f"{row['vs_eager']:.2f}x",
                      f"{row['vs_torch_compile']:.2f}x", "✓" if row["tokens_match"] else "✗")
    Console(width=160).print(table)  # wide enough for every column when not on a terminal


def plot(rows: list[dict[str, Any]], batch_sizes: list[int], path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(6 * len(batch_sizes), 4), squeeze=False)
    for ax, batch in zip(axes[0], batch_sizes):
        ours = [r for r in rows if r["batch"] == batch]
        bars = ax.barh([r["variant"] for r in ours], [r["tokens_per_s_median"] for r in ours])
        ax.bar_label(bars, labels=[f"{r['vs_eager']:.2f}x" for r in ours], padding=3)
        ax.invert_yaxis()
        ax.margins(x=0.15)  # room for the ratio labels
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("tokens/s (median round); label: vs eager")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--levels", default="1,2", help="graphopt levels, each with and without device graphs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=10, help="timed generate() calls per variant and batch")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reuse-cache", action="store_true",
                        help="pass one StaticCache per variant and batch size, reset per call, "
                             "instead of cache_implementation='static' (a new cache per call)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = build_model(args).to(args.device)
    variants = make_variants(args, base)
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt_len), generator=torch.Generator().manual_seed(b))
               .to(args.device) for b in args.batch_sizes}
    # With --reuse-cache, one StaticCache per variant and batch size, reset before each
    # call: device graphs then read the same cache tensors every call, while a new
    # cache per call means a recapture per call.
    caches = {(name, b): transformers.StaticCache(config=model.config, max_cache_len=args.prompt_len +
                                                  args.new_tokens) if args.reuse_cache else None
              for name, model in variants.items() for b in args.batch_sizes}
    steps: dict[str, Callable] = {
        name: (lambda ids, m=model, n=name: generate(m, ids, args.new_tokens, caches[n, ids.shape[0]]))
        for name, model in variants.items()}
    # One generate() per round; interleaved_times first runs each 4 times per batch
    # size, which compiles every graph and captures the device graphs.
    times = interleaved_times(steps, args.batch_sizes, lambda b: (prompts[b],), args.rounds, 1, args.device)

    with torch.inference_mode():
        tokens = {(name, b): steps[name](prompts[b]).cpu()
                  for name in variants for b in args.batch_sizes}
    rows = figures(args, times, tokens, list(variants))
    print_table(args, rows)
    found = notes(variants)
    for name, note in found.items():
        print(f"{name}: {note['graphs']} graphs, {note['captures']} captures, {note['recaptures']} recaptures, "
              f"{note['replays']} replays, {note['recompiles']} recompiles")
        for reason in note["fallbacks"]:
            print(f"    fallback: {reason}")

    args.out.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"}  # JSON has no Path
    setup.update(torch=torch.__version__, transformers=transformers.__version__)
    (args.out / "hf_generate.json").write_text(json.dumps({"setup": setup, "results": rows, "reports": found},
                                                          indent=2))
    print(f"figures: {args.out / 'hf_generate.json'}")
    print(plot(rows, args.batch_sizes, args.out / "hf_generate.png"))


if __name__ == "__main__":
    main()
