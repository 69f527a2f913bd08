"""Start-up time: seconds from process start to the first tokens, first and second start.

Each variant runs in a fresh child process twice against one fresh cache directory
(graphopt's and Inductor's): the first start compiles everything, the second finds
what the first stored. The reference decoder and a tiny random-weight HF Llama,
4 new tokens at batch 4 ("first tokens"), then at batch sizes 1, 13 and 32 as a
server meets them ("all sizes", max_num_seqs=32: 7 capture sizes).

    python benchmarks/startup.py                     # every variant, both models
    python benchmarks/startup.py --models decoder --variants "graphopt level 1"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

VARIANTS = ["torch.compile", "graphopt level 1", "graphopt level 2", "graphopt level 1 + graphs",
            "graphopt level 2 frozen"]
MODELS = ["decoder", "hf-llama"]
BATCH, PROMPT, NEW_TOKENS = 4, 8, 4
LATER_BATCHES, MAX_NUM_SEQS = (1, 13, 32), 32


def child(model_name: str, variant: str) -> None:
    """Build the model, compile it as `variant`, generate at each batch size; print
    seconds since spawn at the first tokens and after every size, and cache hits."""
    import torch

    import graphopt
    import graphopt.models

    torch.manual_seed(0)
    if variant == "torch.compile":
        compile_fn = lambda fn: torch.compile(fn)  # noqa: E731
    else:
        level = int(variant.split()[2])
        options = graphopt.GraphOptimizationConfig(
            graph_opt_level=level, use_cudagraph=variant.endswith("graphs"), max_num_seqs=MAX_NUM_SEQS,
            freeze_parameters=variant.endswith("frozen"))
        compile_fn = lambda fn: graphopt.optimize(fn, options)  # noqa: E731
    if model_name == "decoder":
        model = graphopt.models.Decoder(graphopt.models.DecoderConfig.tiny(max_num_seqs=MAX_NUM_SEQS)).eval()
        step = compile_fn(model)

        def run(batch: int) -> None:
            graphopt.models.generate(model, torch.randint(500, (batch, PROMPT)), NEW_TOKENS, step=step)
    else:
        import transformers

        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(config).eval()
        model.forward = step = compile_fn(model.forward)

        def run(batch: int) -> None:
            with torch.inference_mode():
                model.generate(torch.randint(500, (batch, PROMPT)), max_new_tokens=NEW_TOKENS, do_sample=False,
                               cache_implementation="static", pad_token_id=0)
    spawned = float(os.environ["STARTUP_SPAWNED"])
    run(BATCH)
    first = time.time() - spawned
    for batch in LATER_BATCHES:
        run(batch)
    hits = step.report().cache_hits if hasattr(step, "report") else None
    print(json.dumps({"first": first, "all": time.time() - spawned, "cache_hits": hits}))


def start(model_name: str, variant: str, cache_dir: str) -> dict:
    env = dict(os.environ, GRAPHOPT_CACHE_DIR=os.path.join(cache_dir, "graphopt"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"), STARTUP_SPAWNED=str(time.time()))
    done = subprocess.run([sys.executable, __file__, "--child", model_name, variant], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} / {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    console = Console()
    table = Table(title=f"Start-up, seconds from spawn: to the first {NEW_TOKENS} tokens at batch {BATCH} / after "
                        f"batch sizes {', '.join(map(str, LATER_BATCHES))} too (fresh process each, one cache "
                        "directory per variant)")
    for column in ("model", "variant", "first start", "second start", "ratio", "cache hits"):
        table.add_column(column, justify="left" if column in ("model", "variant") else "right")
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            with tempfile.TemporaryDirectory() as cache_dir:
                console.print(f"[dim]{model_name} / {variant} ...[/dim]")
                first, second = start(model_name, variant, cache_dir), start(model_name, variant, cache_dir)
            hits = second["cache_hits"]
            table.add_row(model_name, variant, f"{first['first']:.1f} / {first['all']:.1f}",
                          f"{second['first']:.1f} / {second['all']:.1f}",
                          f"{first['first'] / second['first']:.1f}x / {first['all'] / second['all']:.1f}x",
                          "-" if hits is None else str(hits))
    console.print(table)


if __name__ == "__main__":
    main()
