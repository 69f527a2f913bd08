"""graph_opt_level="auto"'s first call and its time to the final choice, against
torch.compile's first call, graphopt level 1's, and auto compiling level 2 in the
first call (as it did before level 2 moved to a child process). Each contender runs in
a fresh process (a process's first compile pays one-time costs), rounds interleaved;
medians.

    python benchmarks/first_call_auto.py --models mlp,bert,sdpa --rounds 3
    python benchmarks/first_call_auto.py --models decoder --frozen --rounds 3

`--frozen` compiles with freeze_parameters=True (torch.compile as it is); `decoder` is
the reference decoder's decode step at `DecoderConfig.small` (3.4M parameters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

CONTENDERS = ("compile", "l1", "auto", "auto-in-first-call")


def build(name: str):
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                    torch.nn.Linear(512, 256)).eval()
        return model, (torch.randn(8, 256),)
    if name in ("interleaved", "sdpa", "baddbmm", "grouped"):  # a decoder spelling's decode step
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from decoder_spellings import SPELLINGS, decode_inputs

        return SPELLINGS[name]().eval(), decode_inputs(4, 5)
    if name == "decoder":
        import graphopt.models

        model = graphopt.models.Decoder(graphopt.models.DecoderConfig.small(max_num_seqs=4, max_seq_len=128)).eval()
        return model, (torch.randint(2048, (4,)), torch.full((4,), 5), torch.arange(4))
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=256)).eval()
    return model, (torch.randint(0, 1000, (1, 64)),)


def one(name: str, how: str, frozen: bool) -> None:
    """In this process: `how`'s first call on `name`, then calls until the choice is made."""
    import graphopt
    from graphopt.backend import tiers

    torch.set_num_threads(1)
    model, args = build(name)
    if how == "auto-in-first-call":
        choose = tiers.choose
        tiers.choose = lambda *a, **k: choose(*a[:6])  # without in_background
    backend = None
    if how == "compile":
        compiled = torch.compile(model)
    else:
        level = 1 if how == "l1" else "auto"
        backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=level, cache_dir=None,
                                                                    freeze_parameters=frozen))
        compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        expected = model(*args)
        start = time.perf_counter()
        out = compiled(*args)
        first = chosen = time.perf_counter() - start
        while backend is not None and any("level" not in r for r in backend.report().level_choices):
            time.sleep(0.05)  # a server's next request
            out = compiled(*args)
            chosen = time.perf_counter() - start

    def leaf(o):
        return o if isinstance(o, torch.Tensor) else o[0]

    error = (leaf(out) - leaf(expected)).abs().max().item()
    levels = [r.get("level") for r in backend.report().level_choices] if backend is not None else []
    print(f"RESULT {first:.3f} {chosen:.3f} {error:.1e} {levels}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,bert")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frozen", action="store_true", help="graphopt with freeze_parameters=True")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(*args.one, args.frozen)
    for name in args.models.split(","):
        found: dict[str, list[tuple[float, float]]] = {how: [] for how in CONTENDERS}
        for _ in range(args.rounds):
            for how in CONTENDERS:
                with tempfile.TemporaryDirectory() as cold:
                    out = subprocess.run([sys.executable, __file__, "--one", name, how]
                                         + ["--frozen"] * args.frozen, capture_output=True,
                                         text=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cold})
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
                if line is None:
                    sys.exit(f"{name} {how} failed:\n{out.stderr[-2000:]}")
                first, chosen, error, levels = line.split(maxsplit=4)[1:]
                found[how].append((float(first), float(chosen)))
                print(f"  {name} {how}: first call {float(first):.1f} s, final choice {float(chosen):.1f} s, "
                      f"max|out - eager| {error}, levels {levels}", flush=True)
        base = statistics.median(f for f, _ in found["compile"])
        for how, runs in found.items():
            first, chosen = statistics.median(f for f, _ in runs), statistics.median(c for _, c in runs)
            print(f"{name:5} {how:19} first call {first:6.1f} s ({first / base:.2f}x torch.compile's)   "
                  f"final choice at {chosen:6.1f} s", flush=True)


if __name__ == "__main__":
    main()
