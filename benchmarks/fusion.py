"""What the fusion library does: fused ops per model, and the decode step with and
without fusion.

Part 1 optimizes the reference decoder and tiny transformers models (random
weights; eager attention, so attention is written out) at level 1 with frozen
parameters, with the fusion passes on and off: ops in the final graph, the fused
ops it ended with, and the largest difference from eager.
Part 2 times the reference decoder's decode step at level 1, fusion off against on,
without and with device graphs, in interleaved rounds in one process.

    python benchmarks/fusion.py --threads 1
    python benchmarks/fusion.py --device cuda --config bench   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.models import Decoder, DecoderConfig
from graphopt.passes.fusion import fusion_passes

FUSIONS = [name for name in fusion_passes() if name != "user_replacements"]


def _transformers_models() -> dict[str, Callable[[], tuple[torch.nn.Module, dict]]]:
    import transformers

    def inputs(batch: int = 2, seq: int = 8) -> dict:
        return {"input_ids": torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))}

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64)
    return {
        "Llama": lambda: (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=2, attn_implementation="eager", **common)), inputs()),
        "GPT-2": lambda: (transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64, bos_token_id=0,
            eos_token_id=0, attn_implementation="eager")), inputs()),
        "Qwen2": lambda: (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            num_key_value_heads=2, attn_implementation="eager", **common)), inputs()),
        "BERT": lambda: (transformers.BertModel(transformers.BertConfig(
            attn_implementation="eager", **common)), inputs()),
    }


def _decoder(config: DecoderConfig, device: str) -> Callable[[], tuple[torch.nn.Module, dict]]:
    def build() -> tuple[torch.nn.Module, dict]:
        batch = 4
        ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
        positions = torch.full((batch,), 3, device=device)
        return Decoder(config).to(device), {"input_ids": ids.to(device), "positions": positions,
                                            "slots": torch.arange(batch, device=device)}
    return build


def _leaves(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def fused_op_table(models: dict[str, Callable[[], tuple[torch.nn.Module, dict]]]) -> Table:
    table = Table(title="level 1, freeze_parameters=True: ops in the final graph(s) and the fused ops")
    for column in ("model", "ops without fusion", "ops with fusion", "fused ops", "max |diff| vs eager"):
        table.add_column(column, justify="right" if column.startswith(("ops", "max")) else "left")
    for name, build in models.items():
        ops, fused, diff = {}, {}, 0.0
        for fusion in (False, True):
            torch.manual_seed(0)
            model, kwargs = build()
            model.eval()
            config = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, freeze_parameters=True,
                                                      disabled_passes=[] if fusion else FUSIONS)
            opt = graphopt.optimize(model, config)
            with torch.no_grad():
                expected, got = _leaves(model(**kwargs)), _leaves(opt(**kwargs))
            diff = max(diff, *((a - b).abs().max().item() for a, b in zip(expected, got)))
            report = opt.report()
            ops[fusion] = sum(g.nodes_after for g in report.graphs)
            if fusion:
                for g in report.graphs:
                    for op, count in g.fused_ops.items():
                        fused[op] = fused.get(op, 0) + count
        table.add_row(name, str(ops[False]), str(ops[True]),
                      ", ".join(f"{op} {n}" for op, n in fused.items()) or "-", f"{diff:.1e}")
    return table


def step_time_table(config: DecoderConfig, device: str, batch_sizes: list[int], rounds: int, steps: int) -> Table:
    torch.manual_seed(0)
    model = Decoder(config).eval().to(device)
    variants: dict[str, Any] = {"eager": model}
    for graphs in (False, True):
        for fusion in (False, True):
            name = f"level 1{' + device graphs' if graphs else ''}, fusion {'on' if fusion else 'off'}"
            cfg = graphopt.GraphOptimizationConfig(
                graph_opt_level=1, use_cudagraph=graphs, cudagraph_capture_sizes=batch_sizes,
                freeze_parameters=True, disabled_passes=[] if fusion else FUSIONS)
            variants[name] = graphopt.optimize(model, cfg, pad_values={"slots": model.scratch_slot})

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
        return tuple(x.to(device) for x in (ids, torch.full((batch,), 7), torch.arange(batch)))

    times = interleaved_times(variants, batch_sizes, inputs, rounds, steps, device)

    table = Table(title="decode step of the reference decoder, level 1 with fusion off and on",
                  caption=f"torch {torch.__version__} · {device} · {torch.get_num_threads()} thread(s) · "
                          f"{rounds} interleaved rounds of {steps} steps")
    for column in ("batch", "variant", "ops", "best µs", "median µs", "vs eager (best)", "fusion on vs off"):
        table.add_column(column, justify="right")
    for batch in batch_sizes:
        eager = min(times["eager", batch])
        for name, step in variants.items():
            best = min(times[name, batch])
            # batch 1 and the other sizes get a graph each; a step runs one of them
            ops = "" if name == "eager" else str(max(g.nodes_after for g in step.report().graphs))
            off = times.get((name.replace("fusion on", "fusion off"), batch))
            versus = f"{min(off) / best:.2f}x" if name.endswith("fusion on") else ""
            table.add_row(str(batch), name, ops, f"{best:.0f}", f"{statistics.median(times[name, batch]):.0f}",
                          f"{eager / best:.2f}x", versus)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-models", action="store_true", help="only time the decode step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = getattr(DecoderConfig, args.config)()
    console = Console(width=160)
    if not args.skip_models:
        models = {"reference decoder": _decoder(config, args.device)}
        if args.device == "cpu":
            models.update(_transformers_models())
        console.print(fused_op_table(models))
    console.print(step_time_table(config, args.device, [int(b) for b in args.batch_sizes.split(",")],
                                  args.rounds, args.steps))


if __name__ == "__main__":
    main()
