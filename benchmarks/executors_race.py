"""The executors' race against the engines run alone, in one process: graphopt at level 1
with frozen weights and `executors=["onnxruntime", "openvino"]`, at float32 and at
`compute_dtype="bfloat16"` (and at bfloat16 with `guards="inputs"`, the guards a serving
engine keeps); each race's candidate medians and its pick; then the three
steps and graphopt's level 2 in bfloat16 (frozen, no engines) timed beside OpenVINO
f32, OpenVINO bf16 and ONNX Runtime, each on a static
`torch.onnx.export` of the eager model, and `torch.compile` (default mode) of the model
in float32 and of a bfloat16 copy (its float inputs cast, as a user who casts the
model would), interleaved round by round, medians. The last columns are each
contender's time over the step's (>= 1: the step is as fast).

    python benchmarks/executors_race.py bert --batches 1 8
    python benchmarks/executors_race.py resnet18 --batches 1 8 --threads 1
"""

from __future__ import annotations

import argparse
import copy

import torch

import graphopt
from graphopt.backend import candidates, engines
from graphopt.bench.vision import ResNet18
from graphopt.passes import lowered_error


def model_and_inputs(name: str):
    """BERT (hidden 256, 4 layers, sequence 64) or ResNet-18 at 112², random weights."""
    torch.manual_seed(0)
    if name == "bert":
        import transformers

        from graphopt.bench.workloads import BertEncoder

        config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, intermediate_size=1024, max_position_embeddings=64)
        generator = torch.Generator().manual_seed(1)
        return BertEncoder(config).eval(), lambda b: (torch.randint(0, 1000, (b, 64), generator=generator),
                                                      torch.ones(b, 64, dtype=torch.long))
    generator = torch.Generator().manual_seed(1)
    return ResNet18().eval(), lambda b: (torch.randn(b, 3, 112, 112, generator=generator),)


def raced(eager: torch.nn.Module, args: tuple, **config) -> graphopt.OptimizedModule:
    """A step whose race has run on `args`, its candidates' medians printed."""
    step = graphopt.optimize(copy.deepcopy(eager), graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True, executors=["onnxruntime", "openvino"], **config))
    step(*args)
    for record in step.report().executors:
        medians = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in record["seconds"].items())
        print(f"  race ({config or 'float32'}): pick {record['executor']}; {medians}")
        for name, error in record.get("precision", {}).items():
            print(f"    {name}: max abs error {error['max_abs_error']:.3g}, "
                  f"{error['relative_error']:.3g} of the output's magnitude")
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["bert", "resnet18"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    eager, inputs = model_and_inputs(options.model)
    for batch in options.batches:
        torch._dynamo.reset()
        args = inputs(batch)
        print(f"{options.model} batch {batch}")
        with torch.inference_mode():
            expected = eager(*args)
            f32, bf16 = raced(eager, args), raced(eager, args, compute_dtype="bfloat16")
            trusting = raced(eager, args, compute_dtype="bfloat16", guards="inputs")
            level2 = graphopt.optimize(copy.deepcopy(eager), graphopt.GraphOptimizationConfig(
                graph_opt_level=2, freeze_parameters=True, compute_dtype="bfloat16"))
            level2(*args)
            with engines.quiet_export():
                model = torch.onnx.export(eager, args, dynamo=True).model_proto.SerializeToString()
            arrays = [a.numpy() for a in args]
            compiled32 = torch.compile(copy.deepcopy(eager))
            compiled16 = torch.compile(copy.deepcopy(eager).to(torch.bfloat16))
            args16 = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
            ov32, ov16 = (engines.openvino_runner(model, options.threads, p) for p in ("f32", "bf16"))
            ort = engines.runner("onnxruntime", "f32", model)
            contenders = {"graphopt f32": lambda: f32(*args), "graphopt bf16": lambda: bf16(*args),
                          "bf16 guards=inputs": lambda: trusting(*args),
                          "graphopt L2 bf16": lambda: level2(*args),
                          "openvino f32": lambda: ov32(arrays)[0], "openvino bf16": lambda: ov16(arrays)[0],
                          "onnxruntime": lambda: ort(arrays)[0],
                          "compile f32": lambda: compiled32(*args), "compile bf16": lambda: compiled16(*args16)}
            errors = {k: lowered_error.worst_error([expected], [run()])[1] for k, run in contenders.items()}
            seconds = candidates.median_seconds(contenders, (), options.rounds, 0.15)
        for name, s in seconds.items():
            print(f"  {name:16s} {s * 1e3:8.2f} ms  max abs error {errors[name]:.2g}  "
                  f"/ f32 step {s / seconds['graphopt f32']:5.2f}  / bf16 step {s / seconds['graphopt bf16']:5.2f}")


if __name__ == "__main__":
    main()
