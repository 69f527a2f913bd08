"""Start-up time: seconds from process start to the first tokens, first and second start.

Each variant runs in a fresh child process twice against one fresh cache directory
(graphopt's and Inductor's): the first start compiles everything, the second finds
what the first stored. The reference decoder and a tiny random-weight HF Llama,
4 new tokens at batch 4.

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

VARIANTS = ["torch.compile", "graphopt level 1", "graphopt level 2", "graphopt level 1 + graphs"]
MODELS = ["decoder", "hf-llama"]
BATCH, PROMPT, NEW_TOKENS = 4, 8, 4


def child(model_name: str, variant: str) -> None:
    """Build the model, compile it as `variant`, generate; print seconds since spawn and cache hits."""
    import torch

    import graphopt
    import graphopt.models

    torch.manual_seed(0)
    if variant == "torch.compile":
        compile_fn = lambda fn: torch.compile(fn)  # noqa: E731
    else:
        level = int(variant.split()[2])
        config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=variant.endswith("graphs"),
                                                  max_num_seqs=BATCH)
        compile_fn = lambda fn: graphopt.optimize(fn, config)  # noqa: E731
    ids = torch.randint(500, (BATCH, PROMPT))
    if model_name == "decoder":
        model = graphopt.models.Decoder(graphopt.models.DecoderConfig.tiny()).eval()
        step = compile_fn(model)
        graphopt.models.generate(model, ids, NEW_TOKENS, step=step)
    else:
        import transformers

        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(config).eval()
        model.forward = step = compile_fn(model.forward)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                           pad_token_id=0)
    hits = getattr(step.report(), "cache_hits", None) if hasattr(step, "report") else None
    print(json.dumps({"seconds": time.time() - float(os.environ["STARTUP_SPAWNED"]), "cache_hits": hits}))


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
    table = Table(title=f"Start-up to the first {NEW_TOKENS} tokens at batch {BATCH} (s, fresh process each)")
    for column in ("model", "variant", "first start", "second start", "ratio", "cache hits"):
        table.add_column(column, justify="left" if column in ("model", "variant") else "right")
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            with tempfile.TemporaryDirectory() as cache_dir:
                console.print(f"[dim]{model_name} / {variant} ...[/dim]")
                first, second = start(model_name, variant, cache_dir), start(model_name, variant, cache_dir)
            hits = second["cache_hits"]
            table.add_row(model_name, variant, f"{first['seconds']:.1f}", f"{second['seconds']:.1f}",
                          f"{first['seconds'] / second['seconds']:.1f}x", "-" if hits is None else str(hits))
    console.print(table)


if __name__ == "__main__":
    main()
