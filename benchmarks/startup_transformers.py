"""Start-up of transformers' LlamaForCausalLM at real scale, as a user meets it: the model
saved once with `save_pretrained` (random weights) and loaded with `from_pretrained` in
each fresh process, then one forward of a 16-token prompt (the first call), one of 24
tokens (a second length: a second trace), and three more of 16 tokens timed (the step).

Each contender starts twice against one new cache directory (graphopt's and Inductor's):
the first start compiles everything, the second finds what the first stored. Seconds are
counted from the process's launch, so loading the weights (the same for every contender)
is in them; peak RSS is the process's own.

    python benchmarks/startup_transformers.py                        # ~0.85B: hidden 2048, 16 layers
    python benchmarks/startup_transformers.py --hidden 512 --layers 2 --contenders compile,L2+frozen
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

CONTENDERS = {"compile": None, "L1+frozen": (1, True), "L2+frozen": (2, True), "default": ("auto", False),
              "auto+frozen": ("auto", True)}
PROMPT, SECOND_PROMPT, VOCAB = 16, 24, 32000


def prepare(path: str, hidden: int, layers: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      vocab_size=VOCAB, use_cache=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def child(path: str, contender: str, threads: int) -> None:
    launched = float(os.environ["STARTUP_SPAWNED"])
    import torch
    import transformers

    import graphopt
    from graphopt.bench.startup import peak_rss

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    found = {"loaded": time.time() - launched}
    if CONTENDERS[contender] is None:
        step = torch.compile(model)
    else:
        level, frozen = CONTENDERS[contender]
        step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=level,
                                                                          freeze_parameters=frozen))
    prompts = [torch.randint(VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (PROMPT, SECOND_PROMPT)]
    with torch.inference_mode():
        logits = step(prompts[0]).logits
        found["first"] = time.time() - launched
        step(prompts[1])
        found["second_length"] = time.time() - launched
        began = time.perf_counter()
        for _ in range(3):
            step(prompts[0])
        found["step_ms"] = (time.perf_counter() - began) / 3 * 1e3
        found["error"] = (logits - model(prompts[0]).logits).abs().max().item()
    found["peak_gib"] = peak_rss() / 2**30
    print(json.dumps(found))


def start(path: str, contender: str, threads: int, cache_dir: str) -> dict:
    env = dict(os.environ, GRAPHOPT_CACHE_DIR=os.path.join(cache_dir, "graphopt"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"), STARTUP_SPAWNED=repr(time.time()))
    done = subprocess.run([sys.executable, __file__, "--child", path, contender, "--threads", str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="compile,L2+frozen,L1+frozen,default")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="each contender's pair of starts, in turn")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.threads)
        return
    console = Console() if sys.stdout.isatty() else Console(width=160)  # a log: the table's full width
    table = Table(title=f"LlamaForCausalLM, hidden {args.hidden}, {args.layers} layers (from_pretrained), "
                        f"{args.threads} threads: seconds from launch, first start / second start")
    for column in ("contender", "weights loaded", f"first call ({PROMPT} tokens)",
                   f"+ a {SECOND_PROMPT}-token call", "second / first", "step ms", "peak RSS GiB", "max |error|"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    with tempfile.TemporaryDirectory(prefix="startup-transformers-") as saved:
        prepare(saved, args.hidden, args.layers)
        for _ in range(args.rounds):
            for contender in args.contenders.split(","):
                with tempfile.TemporaryDirectory() as cache_dir:
                    console.print(f"[dim]{contender} ...[/dim]")
                    cold, warm = (start(saved, contender, args.threads, cache_dir) for _ in range(2))
                table.add_row(contender, f"{cold['loaded']:.1f} / {warm['loaded']:.1f}",
                              f"{cold['first']:.1f} / {warm['first']:.1f}",
                              f"{cold['second_length']:.1f} / {warm['second_length']:.1f}",
                              f"{warm['first'] / cold['first']:.2f}x", f"{warm['step_ms']:.0f}",
                              f"{cold['peak_gib']:.1f}", f"{cold['error']:.1e}")
    console.print(table)


if __name__ == "__main__":
    main()
