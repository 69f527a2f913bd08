import pytest
import torch

import graphopt
from graphopt.config import tolerance
from graphopt.models import ResNet, ResNetConfig

ATOL, RTOL = tolerance(torch.float32)


def make_model(**overrides) -> ResNet:
    torch.manual_seed(0)
    return ResNet(ResNetConfig.tiny(**overrides))


def test_tiny_model_is_built_for_inference_and_classifies_nchw_images():
    model = make_model()
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == 78042
    x = model.example_input(3)
    assert x.shape == (3, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (3, 10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 9  # stem, two per block, a 1x1 shortcut in each downsampling block
    assert [c.stride for c in convs if c.kernel_size == (1, 1)] == [(2, 2), (2, 2)]


def test_batch_norm_is_not_an_identity():
    bn = make_model().stem.bn
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))


def test_rows_are_independent():
    model = make_model()
    x = model.example_input(4)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[1:2], model(x[1:2]), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("overrides, message", [
    (dict(image_size=0), "image_size must be positive"),
    (dict(stage_channels=()), "stage_channels"),
    (dict(image_size=30), "divisible"),
    (dict(dtype=torch.int32), "floating-point"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ResNetConfig.tiny(**overrides)


def test_level_1_matches_eager():
    model = make_model()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    with torch.no_grad():
        for batch in (1, 5):
            x = model.example_input(batch)
            torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)
